"""Checkpoints of 8-bit and per-block optimizer state (issue 11): save at W = 4 with each
optimizer's block semantics, load at W = 2 and W = 1, continue training. Every function takes
``(rank, world, ...)``; every rank sees the whole batch. Weights have more than 4096 elements, so
bitsandbytes keeps 8-bit state for them (its pieces are >= 4096 elements under ``bnb8bit``);
biases keep fp32 state. Muon runs on the matrices with AdamW on the biases (two optimizers).
``bnb8bit_every``: the README's recipe, bitsandbytes AdamW8bit over every piece, empty ones too,
with each tensor whole on one rank (``matrix`` semantics): the other ranks' optimizers hold its
empty piece with fp32 state beside the holder's 8-bit state ([Note: empty pieces hold no state]).
"""

from __future__ import annotations

import os

import torch
from _average import average_of
from torch import nn

import blockshard
from blockshard.runtime import PieceTensor, load_checkpoint, optimizer_state_dict, save_checkpoint

NAMES = ("adamw", "bnb8bit", "muon", "shampoo", "bnb8bit_every")
SEMANTICS = {"adamw": None, "bnb8bit": "bnb8bit", "muon": "matrix", "shampoo": "shampoo:32", "bnb8bit_every": "matrix"}
STEPS_BEFORE, STEPS_AFTER = 2, 2


def model(seed: int) -> nn.Module:
    """Weights of 24832, 17152 and 20100 elements (8-bit state), odd shapes for 32-row Shampoo tiles."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Sequential(nn.Linear(97, 256), nn.GELU()),
            nn.Sequential(nn.Linear(256, 67), nn.GELU()),
            nn.Linear(67, 300),
        )


def batches() -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 97, generator=g), torch.randn(16, 300, generator=g)) for _ in range(4)]


def optimizers(name: str, m: nn.Module) -> list[torch.optim.Optimizer]:
    """The same optimizers on every rank; ranks leave out their empty pieces (a ``param_group``
    may be empty: at W = 4 a rank holds none of Muon's three matrices), except ``bnb8bit_every``."""
    if name == "bnb8bit_every":
        import bitsandbytes as bnb

        return [bnb.optim.AdamW8bit(m.parameters(), lr=1e-3)]
    params = [{"params": [p for p in m.parameters() if p.numel() > 0]}]
    if name == "adamw":
        return [torch.optim.AdamW(params, lr=0.01)]
    if name == "bnb8bit":
        import bitsandbytes as bnb

        return [bnb.optim.AdamW8bit(params, lr=1e-3)]
    if name == "muon":
        mats = [{"params": [p for p in params[0]["params"] if p.ndim == 2]}]
        rest = [{"params": [p for p in params[0]["params"] if p.ndim != 2]}]
        return [torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)]
    from blockshard.optim import BlockedShampoo

    return [BlockedShampoo(params, lr=1e-2, max_preconditioner_dim=32)]


def build(name: str, seed: int, sharded: bool, semantics: object = "default") -> nn.Module:
    m = model(seed)
    if sharded:
        sem = SEMANTICS[name] if semantics == "default" else semantics
        rules = {"*weight": sem, "*bias": "elementwise" if name == "muon" else sem} if sem else None
        for block in (m[0], m[1]):
            blockshard.fully_shard(block, semantics=rules, policy="whole")  # whole units: unmodified optimizers
        blockshard.fully_shard(m, semantics=rules, policy="whole")
    return m


def train(m: nn.Module, opts: list, data: list, averaged_over: int = 1) -> None:
    """``averaged_over=W``: each gradient averaged as W ranks average it (``_average.average_of``)."""
    for x, y in data:
        ((m(x) - y) ** 2).mean().backward()
        if averaged_over > 1:
            for p in m.parameters():
                if p.grad is not None:
                    average_of(averaged_over, p.grad)
        for o in opts:
            o.step()
            o.zero_grad()


def pieces(m: nn.Module, opts: list) -> dict[str, tuple]:
    """Every PieceTensor entry of the optimizers' state: ``name -> (global shape, start, local)``."""
    out = {}
    for i, o in enumerate(opts):
        for pname, entries in optimizer_state_dict(m, o)["state"].items():
            for key, v in _flat(entries):
                if isinstance(v, PieceTensor):
                    out[f"{i}.{pname}.{key}"] = (tuple(v.shape), v.local_start, v.to_local().clone())
    return out


def _flat(entries: dict, prefix: str = ""):
    for k, v in entries.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def reference(rank: int, world: int, resumed_over: int = 1) -> dict:
    """One process, no sharding, uninterrupted; ``resumed_over=W``: the steps after the save with
    gradients averaged as W ranks average them (what a resume at W = 3 must equal bitwise)."""
    out = {}
    for name in NAMES:
        m = build(name, 0, sharded=False)
        opts = optimizers(name, m)
        train(m, opts, batches()[:STEPS_BEFORE])
        train(m, opts, batches()[STEPS_BEFORE:], resumed_over)
        out[name] = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return out


def save(rank: int, world: int, path: str) -> dict:
    """Train, save each optimizer's checkpoint (model + state), train on: the state as saved and
    the final parameters."""
    out = {}
    for name in NAMES:
        m = build(name, 0, sharded=True)
        opts = optimizers(name, m)
        train(m, opts, batches()[:STEPS_BEFORE])
        save_checkpoint(m, os.path.join(path, name), opts)
        state = pieces(m, opts)
        held = live_state1(m, opts)
        train(m, opts, batches()[STEPS_BEFORE:])
        out[name] = {"state": state, "final": blockshard.full_state_dict(m), "state1": held}
    return out


def live_state1(m: nn.Module, opts: list) -> dict[str, tuple[int, str]]:
    """``name -> (piece numel, dtype of the live state1)`` for the pieces a bitsandbytes optimizer holds."""
    names = {id(p): n for n, p in m.named_parameters()}
    return {
        names[id(p)]: (p.numel(), str(s["state1"].dtype)) for o in opts for p, s in o.state.items() if "state1" in s
    }


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def load(rank: int, world: int, path: str) -> dict:
    """Load each checkpoint into a model of other weights at this world size, train on; the
    control resumes the model with a fresh optimizer."""
    out = {}
    for name in NAMES:
        m = build(name, 1, sharded=True)
        opts = optimizers(name, m)
        load_checkpoint(m, os.path.join(path, name), opts)
        state = pieces(m, opts)
        train(m, opts, batches()[STEPS_BEFORE:])
        fresh = build(name, 1, sharded=True)
        load_checkpoint(fresh, os.path.join(path, name))  # the model alone
        fresh_opts = optimizers(name, fresh)
        train(fresh, fresh_opts, batches()[STEPS_BEFORE:])
        out[name] = {"state": state, "final": blockshard.full_state_dict(m), "fresh": blockshard.full_state_dict(fresh)}
    cut = build("bnb8bit", 1, sharded=True, semantics="elementwise")
    out["bnb8bit_elementwise"] = _error(
        lambda: load_checkpoint(cut, os.path.join(path, "bnb8bit"), optimizers("bnb8bit", cut))
    )
    return out
