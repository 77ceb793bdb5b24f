"""State dicts of sharded models: ``model.state_dict()`` (DCP-ready :class:`PieceTensor` entries,
see [Note: state dict entries]), full tensors by name, or each rank's pieces with offsets."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from blockshard.runtime._api import ShardingError, _join, _states_under
from blockshard.runtime._collectives import all_gather_into
from blockshard.runtime._common import ShardedState
from blockshard.runtime._param import ShardedParam
from blockshard.runtime._piece_tensor import PieceTensor
from blockshard.runtime._state import state_of

__all__ = [
    "LocalShard",
    "full_state_dict",
    "install_state_dict_hooks",
    "load_full_state_dict",
    "load_sharded_state_dict",
    "sharded_state_dict",
]


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
    """Full tensors on every rank under the names the unsharded model's ``state_dict()`` has
    (tied parameters under each of their names, as one tensor; buffers included), so a strict
    ``load_state_dict`` into an unsharded model works. One all-gather of the local buffers per
    group, in the parameters' original dtype; everything else is cloned as it is."""
    gathered = _gather_groups(model)
    out: dict[str, torch.Tensor] = {}
    clones: dict[tuple, torch.Tensor] = {}  # tied tensors outside any group stay one tensor
    for name, value in model.state_dict().items():
        if name in gathered:
            out[name] = gathered[name]
        elif isinstance(value, torch.Tensor):
            key = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
            out[name] = clones[key] if key in clones else clones.setdefault(key, value.detach().clone())
        else:
            out[name] = value
    return out


def _gather_groups(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every managed parameter's full value under each of its names (tied names share a tensor)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, st in _states_under(model):
        g, W = st.group, st.group.world_size
        if g.layout is None:
            continue
        full = torch.empty(W * g.layout.segment_numel, dtype=g.orig_dtype, device=g.device)
        for b, S_b in enumerate(g.layout.buckets):
            off = g.layout.bucket_local_offset(b)
            all_gather_into(full[W * off : W * (off + S_b)], g.local[off : off + S_b], g.process_group)
        values = {
            id(sp): full[sp.gathered_offset : sp.gathered_offset + sp.numel].view(sp.shape).clone() for sp in g.params
        }
        for name, sp in _names(st.module, g.params):
            out[_join(prefix, name)] = values[id(sp)]
    return out


def _names(module: nn.Module, params: list[ShardedParam]) -> list[tuple[str, ShardedParam]]:
    """``(name relative to module, param)`` for every name a group's parameter is registered
    under (tied parameters have several), sharded or unsharded as the group is now."""
    by_id = {id(t): sp for sp in params for t in (sp.sharded, sp.unsharded)}
    return [(n, by_id[id(p)]) for n, p in module.named_parameters(remove_duplicate=False) if id(p) in by_id]


# -- model.state_dict() and model.load_state_dict() -------------------------------------------
def install_state_dict_hooks(module: nn.Module) -> None:
    """Make ``module.state_dict()`` return :class:`PieceTensor` entries for its group's parameters
    and ``module.load_state_dict()`` take them (or full tensors) back into the local pieces."""
    module.register_state_dict_post_hook(_state_dict_post_hook)
    module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)


def _state_dict_post_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """Replace each of the group's entries (the local piece, or the gathered view after a forward
    with ``reshard_after_forward=False``) by a :class:`PieceTensor` of its global shape."""
    st = state_of(module)
    if st is None or st.group.layout is None:
        return
    made: dict[int, PieceTensor] = {}
    for name, sp in _names(module, st.group.params):
        key = prefix + name
        if key in state_dict:
            if id(sp) not in made:
                pg = st.group.process_group
                made[id(sp)] = PieceTensor(sp.sharded.detach(), sp.local_start, sp.shape, name=key, process_group=pg)
            state_dict[key] = made[id(sp)]


def _load_state_dict_pre_hook(
    module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *_args: object
) -> None:
    """Turn each of the group's entries into this rank's piece with its block shape, which
    ``nn.Module`` then copies into the sharded parameter. The group is resharded first (as FSDP2
    does), so a gathered copy never outlives the values it was gathered from."""
    st = state_of(module)
    if st is None or st.group.layout is None:
        return
    if local_metadata.get("assign_to_params_buffers"):
        raise ShardingError(
            f"load_state_dict(..., assign=True) on the sharded {st.group.name} would replace the engine's "
            "parameters with new tensors it does not own. Fix: load with assign=False (the default)"
        )
    if st.group.sharded_state is not ShardedState.SHARDED:
        st.group.reshard()
    for name, sp in _names(module, st.group.params):
        key = prefix + name
        if key in state_dict:
            state_dict[key] = _local_piece(key, sp, state_dict[key])


def _local_piece(name: str, sp: ShardedParam, value: object) -> object:
    """This rank's piece of a state-dict entry for ``sp``: a :class:`PieceTensor` of the same piece
    or a full tensor of the parameter's shape."""
    lo, hi = sp.local_start, sp.local_start + sp.local_numel
    if not isinstance(value, torch.Tensor):
        return value  # nn.Module reports the type
    if tuple(value.shape) != sp.shape:
        local = (
            " (this rank's local piece, not the whole tensor)" if tuple(value.shape) == tuple(sp.sharded.shape) else ""
        )
        raise ShardingError(
            f"parameter {name!r}: the state dict holds shape {tuple(value.shape)}{local}, the model's parameter "
            f"has shape {sp.shape}. Fix: load a state dict of this model: model.state_dict() entries through "
            "torch.distributed.checkpoint, or full tensors (blockshard.full_state_dict, an unsharded model's)"
        )
    if isinstance(value, PieceTensor):
        if (value.local_start, value.to_local().numel()) != (lo, sp.local_numel):
            raise ShardingError(
                f"parameter {name!r}: the state dict holds piece [{value.local_start}, "
                f"{value.local_start + value.to_local().numel()}) of it, this rank holds [{lo}, {hi}) (another "
                "world size or semantics). Fix: load it through torch.distributed.checkpoint (dcp.save, then "
                "dcp.load(model.state_dict(), ...)), which moves pieces between ranks, or pass full tensors"
            )
        return value.to_local().view(sp.sharded.shape)
    return value.detach().reshape(-1)[lo:hi].view(sp.sharded.shape)


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
