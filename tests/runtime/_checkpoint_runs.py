"""DCP checkpoints of the ragged engine (issue 11): save at one world size and semantics, load at
another, continue training. Every function takes ``(rank, world, ...)``; ``world == 1`` without a
process group (``run_single``) is the one-process reference. Every rank sees the whole batch.

The optimizer is AdamW; its state is checkpointed by parameter name with global shapes
(``blockshard.optimizer_state_dict``), so a resumed run must continue exactly as the uninterrupted
one. The control resumes the model alone with a fresh AdamW.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import blockshard
from blockshard._tiny import OddMLP, mlp_batches
from blockshard.runtime import PieceTensor, load_checkpoint, load_optimizer_state_dict, optimizer_state_dict
from blockshard.runtime.core._state import state_of

LR = 0.05
BATCHES = mlp_batches(4, 6)  # steps 1-2 before the save, 3-4 after


def _model(seed: int, sharded: bool, semantics: object = None, reshard_after_forward: bool = True) -> nn.Module:
    model = OddMLP(seed)
    if sharded:
        for block in model.blocks:
            blockshard.fully_shard(block, semantics=semantics, reshard_after_forward=reshard_after_forward)
        blockshard.fully_shard(model, semantics=semantics, reshard_after_forward=reshard_after_forward)
    return model


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR)


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer_state_dict(model, opt)}


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list) -> None:
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return blockshard.full_state_dict(model)


def _entries(model: nn.Module) -> dict[str, tuple]:
    out = {}
    for name, v in model.state_dict().items():
        piece = (v.local_start, v.to_local().numel()) if isinstance(v, PieceTensor) else None
        out[name] = (type(v).__name__, tuple(v.shape), piece)
    return out


def uninterrupted(rank: int, world: int) -> dict:
    """One process, no sharding: the state after steps 1-2 and after steps 1-4."""
    model = _model(0, sharded=False)
    opt = _adamw(model)
    _train(model, opt, BATCHES[:2])
    mid = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, BATCHES[2:])
    return {"mid": mid, "final": model.state_dict(), "shapes": {k: tuple(v.shape) for k, v in mid.items()}}


def save(rank: int, world: int, path: str) -> dict:
    """Train 2 steps, save with ``dcp.save(model.state_dict())`` while the blocks are still gathered
    (``reshard_after_forward=False``, the forward of a step whose backward has not run), finish
    that step without an optimizer step, then train 2 more steps."""
    model = _model(0, sharded=True, reshard_after_forward=False)
    opt = _adamw(model)
    _train(model, opt, BATCHES[:2])
    before = _entries(model)
    out = model(BATCHES[0][0])  # the blocks stay gathered until the backward
    gathered = [state_of(m).buffers.sharded_state.name for m in model.blocks]
    after = _entries(model)
    dcp.save(_state(model, opt), checkpoint_id=path)
    out.sum().backward()
    model.zero_grad()
    mid = _full(model)
    # what model.state_dict() returned before checkpoints spoke DCP: local pieces under full names
    pieces = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    _train(model, opt, BATCHES[2:])
    return {"before": before, "after": after, "gathered": gathered, "mid": mid, "pieces": pieces, "final": _full(model)}


def load(
    rank: int, world: int, path: str, semantics: object = None, gathered_first: bool = False, model_only: bool = False
) -> dict:
    """A model of other weights (seed 1), sharded at this world size and ``semantics``: load the
    checkpoint through ``dcp.load`` + ``load_state_dict`` (``model_only``: keep a fresh AdamW),
    then train steps 3-4."""
    model = _model(1, sharded=True, semantics=semantics, reshard_after_forward=not gathered_first)
    opt = _adamw(model)
    fresh = _full(model)
    if gathered_first:  # the blocks hold gathered copies that loading must not leave stale
        out = model(BATCHES[0][0])
        assert state_of(model.blocks[0]).buffers.sharded_state.name == "UNSHARDED"
        del out  # a step abandoned after its forward
    if model_only:
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
    else:
        state = _state(model, opt)
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        load_optimizer_state_dict(model, opt, state["optimizer"])
    loaded = _full(model)
    _train(model, opt, BATCHES[2:])
    return {"fresh": fresh, "loaded": loaded, "final": _full(model)}


def load_variants(rank: int, world: int, path: str, pieces_at_w4: dict) -> dict:
    """At W = 2: plain load, other semantics, gathered blocks, ``blockshard.load_checkpoint``, and
    the bad cases (each returns the error it raised on this rank)."""
    out = {
        "plain": load(rank, world, path),
        "muon": load(rank, world, path, semantics="muon"),
        "gathered": load(rank, world, path, gathered_first=True),
        "model_only": load(rank, world, path, model_only=True),
    }
    model = _model(1, sharded=True, semantics="bnb8bit")
    opt = _adamw(model)
    load_checkpoint(model, path, opt)
    out["load_checkpoint"] = _full(model)
    _train(model, opt, BATCHES[2:])
    out["load_checkpoint_final"] = _full(model)
    out["errors"] = _bad_cases(rank, path, pieces_at_w4)
    return out


def _error(fn) -> str:
    try:
        fn()
    except BaseException as e:  # dcp.load raises CheckpointException, a BaseException
        return f"{type(e).__name__}: {e}"
    return "no error"


def _bad_cases(rank: int, path: str, pieces_at_w4: dict) -> dict[str, str]:
    errors = {}
    model = _model(1, sharded=True)
    # the control: W = 4 rank 0's local pieces under full names cannot be loaded at W = 2
    errors["old_pieces"] = _error(lambda: model.load_state_dict(pieces_at_w4))
    other = nn.Sequential(nn.Linear(13, 7))
    blockshard.fully_shard(other)
    errors["other_model"] = _error(lambda: load_checkpoint(other, path))
    changed = OddMLP(1)
    changed.blocks[2][0] = nn.Linear(29, 5)
    blockshard.fully_shard(changed)
    errors["changed_shapes"] = _error(lambda: load_checkpoint(changed, path, _adamw(changed)))
    errors["changed_shapes_dcp"] = _error(lambda: dcp.load({"model": changed.state_dict()}, checkpoint_id=path))
    broken = f"{path}-broken"
    if rank == 0:
        shutil.copytree(path, broken)
        os.remove(os.path.join(broken, "__1_0.distcp"))
    dist.barrier()
    errors["missing_shard"] = _error(lambda: load_checkpoint(model, broken, _adamw(model)))
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(broken, ".metadata"))
    dist.barrier()
    errors["unfinished"] = _error(lambda: load_checkpoint(model, broken))
    return errors
