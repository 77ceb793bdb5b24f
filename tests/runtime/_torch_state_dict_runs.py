"""torch's ``get_state_dict`` / ``set_state_dict`` (``torch.distributed.checkpoint.state_dict``) on
a blockshard model, as for FSDP2 (issue 11). Every function takes ``(rank, world, ...)``;
``world == 1`` without a process group is the unsharded one-process reference; every rank sees
the whole batch. Optimizers: AdamW and bitsandbytes AdamW8bit (8-bit state, ranks leave their
empty pieces out of the optimizer) on _optim_checkpoint_runs' model, AdamW8bit over every piece,
empty ones too, of whole tensors ("bnb8bit_every", see there), AdamW on a model whose embedding and
head share one weight ("tied").
"""

from __future__ import annotations

import copy
import os

import _optim_checkpoint_runs as ocr
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

import blockshard
from blockshard.runtime import PieceTensor

NAMES = ("adamw", "bnb8bit", "bnb8bit_every", "tied")
FULL = StateDictOptions(full_state_dict=True)
OFFLOAD = StateDictOptions(full_state_dict=True, cpu_offload=True)
FLAT = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
STEPS_BEFORE = 2


class Tied(nn.Module):
    """Embedding and head share one weight (sharded together at the root), a layer between."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed, self.mid, self.head = nn.Embedding(19, 6), nn.Linear(6, 6), nn.Linear(6, 19, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def setup(name: str, seed: int, sharded: bool) -> tuple[nn.Module, list]:
    if name != "tied":
        m = ocr.build(name, seed, sharded)
        return m, ocr.optimizers(name, m)
    m = Tied(seed)
    if sharded:
        blockshard.fully_shard(m.mid)
        blockshard.fully_shard(m)
    return m, [torch.optim.AdamW(m.parameters(), lr=0.05)]


def train(name: str, m: nn.Module, opts: list, steps: slice) -> None:
    if name != "tied":
        return ocr.train(m, opts, ocr.batches()[steps])
    for i in range(4)[steps]:
        ids = (torch.arange(12) * (i + 1)).remainder(19).view(3, 4)
        nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten()).backward()
        for o in opts:
            o.step()
            o.zero_grad()


def _plain(tree):
    """Nested containers with every tensor cloned (PieceTensors as their kind, shape and piece)."""
    if isinstance(tree, PieceTensor):
        return ("PieceTensor", tuple(tree.shape), tree.to_local().numel())
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_plain(v) for v in tree)
    return tree


def _values(m: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def reference(rank: int, world: int) -> dict:
    """Unsharded, uninterrupted: torch's full state dicts after the first steps, the final values,
    and whether the tied names share one tensor."""
    out = {}
    for name in NAMES:
        m, opts = setup(name, 0, sharded=False)
        train(name, m, opts, slice(None, STEPS_BEFORE))
        msd, osd = get_state_dict(m, opts, options=FULL)
        out[name] = {"model": _plain(msd), "optim": _plain(osd)}
        train(name, m, opts, slice(STEPS_BEFORE, None))
        out[name]["final"] = _values(m)
    return out


def save(rank: int, world: int, path: str) -> dict:
    """Sharded: the first steps, torch's full state dicts (plain and ``cpu_offload``), the sharded
    ones saved with ``dcp.save``, the controls (torch's own helpers, unwrapped), the final values."""
    out = {}
    for name in NAMES:
        m, opts = setup(name, 0, sharded=True)
        train(name, m, opts, slice(None, STEPS_BEFORE))
        msd, osd = get_state_dict(m, opts, options=FULL)
        tied = name == "tied" and msd["embed.weight"] is msd["head.weight"]
        off_m, off_o = get_state_dict(m, opts, options=OFFLOAD)
        sharded_m, sharded_o = get_state_dict(m, opts)
        dcp.save({"model": sharded_m, "optim": sharded_o}, checkpoint_id=os.path.join(path, name))
        r = {"full": (_plain(msd), _plain(osd)), "offload": (_plain(off_m), _plain(off_o)), "tied_one_tensor": tied}
        r["sharded"] = (_plain(sharded_m), _plain(sharded_o))
        r["control"] = _unwrapped(m, opts)
        train(name, m, opts, slice(STEPS_BEFORE, None))
        out[name] = r | {"final": blockshard.full_state_dict(m)}
        plain, plain_opts = setup(name, 0, sharded=False)  # torch's helpers wrapped: other models unchanged
        train(name, plain, plain_opts, slice(None, STEPS_BEFORE))
        out[name]["unsharded_full"] = tuple(_plain(d) for d in get_state_dict(plain, plain_opts, options=FULL))
    return out


def _unwrapped(m: nn.Module, opts: list) -> tuple:
    """What torch's own helpers (before blockshard wrapped them) return under full_state_dict=True:
    PieceTensors holding this rank's piece, the optimizer's local state."""
    info = dsd._verify_options(m, tuple(opts), optim_only=False, options=FULL)
    msd = dsd._get_model_state_dict.__wrapped__(m, info)
    osd = dsd._get_optim_state_dict.__wrapped__(m, tuple(opts), info)
    return _plain(msd), _plain(osd)


def load(rank: int, world: int, path: str, ref: dict) -> dict:
    """Into models of other weights at this world size: the unsharded run's full state dicts
    (``set_state_dict(..., full_state_dict=True)``), the sharded checkpoint saved at W = 4
    (``dcp.load`` into ``get_state_dict``'s entries, then ``set_state_dict``) and torch's
    flattened optimizer form, and both broadcast from rank 0 (``broadcast_from_rank0``), each
    continued; the control broadcasts the model alone and keeps a fresh optimizer."""
    out = {}
    for name in NAMES:
        r = {}
        m, opts = setup(name, 1, sharded=True)
        set_state_dict(m, opts, model_state_dict=ref[name]["model"], optim_state_dict=ref[name]["optim"], options=FULL)
        r["full_again"] = (
            _plain(get_model_state_dict(m, options=FULL)),
            _plain(get_optimizer_state_dict(m, opts, options=FULL)),
        )
        train(name, m, opts, slice(STEPS_BEFORE, None))
        r["from_full"] = blockshard.full_state_dict(m)

        m, opts = setup(name, 1, sharded=True)
        sharded_m, sharded_o = get_state_dict(m, opts)
        state = {"model": sharded_m, "optim": sharded_o}
        dcp.load(state, checkpoint_id=os.path.join(path, name))
        set_state_dict(m, opts, model_state_dict=state["model"], optim_state_dict=state["optim"])
        r["loaded"] = blockshard.full_state_dict(m)
        train(name, m, opts, slice(STEPS_BEFORE, None))
        r["from_sharded"] = blockshard.full_state_dict(m)

        m, opts = setup(name, 1, sharded=True)
        flat = dsd._flatten_optim_state_dict(copy.deepcopy(ref[name]["optim"]))
        set_state_dict(m, opts, model_state_dict=ref[name]["model"], optim_state_dict=flat, options=FLAT)
        r["flat_again"] = _plain(get_optimizer_state_dict(m, opts, options=FLAT))
        train(name, m, opts, slice(STEPS_BEFORE, None))
        r["from_flat"] = blockshard.full_state_dict(m)

        m, opts = setup(name, 1, sharded=True)
        given = (ref[name]["model"], ref[name]["optim"]) if rank == 0 else ({}, {})
        # (not set_state_dict: on a rank given an empty model dict it skips the model, torch 2.13 line 1537)
        set_model_state_dict(m, given[0], options=BROADCAST)
        set_optimizer_state_dict(m, opts, given[1], options=BROADCAST)
        r["broadcast"] = blockshard.full_state_dict(m)
        train(name, m, opts, slice(STEPS_BEFORE, None))
        r["from_broadcast"] = blockshard.full_state_dict(m)

        m, opts = setup(name, 1, sharded=True)
        set_model_state_dict(m, ref[name]["model"] if rank == 0 else {}, options=BROADCAST)
        train(name, m, opts, slice(STEPS_BEFORE, None))
        r["model_only"] = blockshard.full_state_dict(m)
        out[name] = r
    return out
