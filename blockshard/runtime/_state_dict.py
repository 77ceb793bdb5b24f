"""State dicts of sharded models: full tensors by name, or each rank's pieces with offsets."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from blockshard.runtime._api import ShardingError, _join, _states_under
from blockshard.runtime._collectives import all_gather_into

__all__ = ["LocalShard", "full_state_dict", "load_full_state_dict", "load_sharded_state_dict", "sharded_state_dict"]


@dataclass(frozen=True)
class LocalShard:
    """One rank's piece of a parameter: elements ``[start, start + tensor.numel())`` of the
    row-major flattening of a tensor of ``global_shape``."""

    tensor: torch.Tensor
    start: int
    global_shape: tuple[int, ...]


def sharded_state_dict(model: nn.Module) -> dict[str, LocalShard]:
    """Every sharded parameter's local piece with its global offset (no communication)."""
    out: dict[str, LocalShard] = {}
    for prefix, st in _states_under(model):
        for sp in st.group.params:
            out[_join(prefix, sp.fqn)] = LocalShard(sp.sharded.detach(), sp.local_start, sp.shape)
    return out


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters by name on every rank (one all-gather of the local buffers per group,
    in the parameters' original dtype); parameters outside any group are included as they are."""
    out: dict[str, torch.Tensor] = {}
    for prefix, st in _states_under(model):
        g, W = st.group, st.group.world_size
        if g.layout is None:
            continue
        full = torch.empty(W * g.layout.segment_numel, dtype=g.orig_dtype, device=g.device)
        for b, S_b in enumerate(g.layout.buckets):
            off = g.layout.bucket_local_offset(b)
            all_gather_into(full[W * off : W * (off + S_b)], g.local[off : off + S_b], g.process_group)
        for sp in g.params:
            out[_join(prefix, sp.fqn)] = full[sp.gathered_offset : sp.gathered_offset + sp.numel].view(sp.shape).clone()
    managed = {id(sp.sharded) for _, st in _states_under(model) for sp in st.group.params}
    managed |= {id(sp.unsharded) for _, st in _states_under(model) for sp in st.group.params}
    for name, p in model.named_parameters():
        if id(p) not in managed and name not in out:
            out[name] = p.detach().clone()
    return out


def _entries(model: nn.Module, state: Mapping[str, object]):
    """``(name, sharded param, saved entry)`` for every parameter of every group under ``model``."""
    for prefix, st in _states_under(model):
        for sp in st.group.params:
            name = _join(prefix, sp.fqn)
            if name not in state:
                raise ShardingError(f"state has no entry for parameter {name!r}; it was saved from another model")
            yield name, sp, state[name]


@torch.no_grad()
def load_sharded_state_dict(model: nn.Module, state: Mapping[str, LocalShard]) -> None:
    """Copy local pieces saved by :func:`sharded_state_dict` back (same world size and layout)."""
    for name, sp, shard in _entries(model, state):
        if (shard.start, shard.tensor.numel(), tuple(shard.global_shape)) != (sp.local_start, sp.local_numel, sp.shape):
            raise ShardingError(
                f"parameter {name!r}: saved piece [{shard.start}, {shard.start + shard.tensor.numel()}) of "
                f"{tuple(shard.global_shape)} does not match this rank's piece [{sp.local_start}, "
                f"{sp.local_start + sp.local_numel}) of {sp.shape}: the layout changed (another world size "
                "or semantics). Fix: load a full state dict with load_full_state_dict instead"
            )
        sp.sharded.copy_(shard.tensor.view(sp.sharded.shape))


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy full tensors (by name, as :func:`full_state_dict` gives them) into the local pieces,
    at any world size."""
    for name, sp, full in _entries(model, state):
        if tuple(full.shape) != sp.shape:
            raise ShardingError(f"parameter {name!r}: saved shape {tuple(full.shape)} != model shape {sp.shape}")
        flat = full.reshape(-1)[sp.local_start : sp.local_start + sp.local_numel]
        sp.sharded.copy_(flat.view(sp.sharded.shape))
