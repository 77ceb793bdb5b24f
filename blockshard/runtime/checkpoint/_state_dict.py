"""State dicts of sharded models: ``model.state_dict()`` (DCP-ready :class:`PieceTensor` entries,
see [Note: state dict entries]), full tensors by name, or each rank's pieces with offsets."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from blockshard._errors import ShardingError
from blockshard.runtime.checkpoint._piece_tensor import PieceTensor, param_entry
from blockshard.runtime.checkpoint._quantized_state import (
    full_quantized_entries,
    load_quantized,
    load_quantized_pieces,
    quantized_entries,
    quantized_pieces,
)
from blockshard.runtime.core._buffers import ParamBuffers
from blockshard.runtime.core._collectives import agree_call, all_gather_into
from blockshard.runtime.core._inspect import agree_on_call, checkpoint_states, join_name, state_name, states_under
from blockshard.runtime.core._param import ShardedParam
from blockshard.runtime.core._state import state_of
from blockshard.runtime.quantized._frozen import frozen_buffers

__all__ = [
    "LocalShard",
    "full_state_dict",
    "install_state_dict_hooks",
    "load_full_state_dict",
    "load_sharded_state_dict",
    "sharded_state_dict",
]

_V = TypeVar("_V")  # the value type of a state dict


@dataclass(frozen=True)
class LocalShard:
    """One rank's piece of a parameter: elements ``[start, start + tensor.numel())`` of the
    row-major flattening of a tensor of ``global_shape`` (``order`` ``"row-major"``), or of its
    tile-major order (``"tile-major R x C"``: a tile-placed FP8 weight's whole tiles, [Note: tile
    placement in the engine])."""

    tensor: torch.Tensor
    start: int
    global_shape: tuple[int, ...]
    order: str = "row-major"


def sharded_state_dict(model: nn.Module) -> dict[str, LocalShard]:
    """Every sharded parameter's local piece with its global offset (no communication); quantized
    weights under the entries ``model.state_dict()`` gives them, each section this rank's piece
    ([Note: quantized state dicts])."""
    out: dict[str, LocalShard] = {}
    for prefix, st in checkpoint_states(model, "state dict"):
        for sp in st.buffers.params:
            order = sp.order.name if sp.order is not None else "row-major"  # [Note: packed tile order]
            out[join_name(prefix, sp.fqn)] = LocalShard(sp.sharded.detach(), sp.local_start, sp.shape, order)
        if (fq := frozen_buffers(st)) is not None:
            pieces = quantized_pieces(st.module, fq, join_name(prefix, ""))
            out |= {name: LocalShard(*piece) for name, piece in pieces.items()}
    return out


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors on every rank under the names the unsharded model's ``state_dict()`` has
    (tied parameters under each of their names, as one tensor; buffers included), so a strict
    ``load_state_dict`` into an unsharded model works. One all-gather of the local buffers per
    group, in the parameters' original dtype; everything else is cloned as it is."""
    agree_on_call(model, "blockshard.full_state_dict")  # [Note: collective headers]
    gathered = _gather_groups(model)
    quantized, owned = full_quantized_entries(model, states_under(model))  # [Note: quantized state dicts]
    gathered |= quantized
    out: dict[str, torch.Tensor] = {}
    clones: dict[tuple[object, ...], torch.Tensor] = {}  # tied tensors outside any group stay one tensor
    for name, value in model.state_dict().items():
        if name in owned and name not in gathered:
            continue  # a sharded-only entry (torchao's inner tensors): the full one holds it
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
    for prefix, st in states_under(model):
        g, W = st.buffers, st.buffers.world_size
        if g.layout is None:
            continue
        full = torch.empty(W * g.layout.segment_numel, dtype=g.orig_dtype, device=g.device)
        for b, S_b in enumerate(g.layout.buckets):
            off = g.layout.bucket_local_offset(b)
            all_gather_into(full[W * off : W * (off + S_b)], g.local[off : off + S_b], g.process_group)
        values = {
            id(sp): sp.full_of_stored(full[sp.gathered_offset : sp.gathered_offset + sp.stored_numel])
            for sp in g.params
        }
        for sp in g.params:  # a TP parameter: its TP-local tensors gathered across tp too (every rank, in order)
            if sp.tp is not None:
                values[id(sp)] = sp.tp.full(values[id(sp)])
        for name, sp in _names(st.module, g.params):  # a wrapper above st.module: its prefix dropped too
            out[join_name(prefix, name)] = values[id(sp)]
    return out


def _names(module: nn.Module, params: list[ShardedParam]) -> list[tuple[str, ShardedParam]]:
    """``(name relative to module, param)`` for every name a group's parameter is registered
    under (tied parameters have several), sharded or unsharded as the group is now."""
    by_id = {id(t): sp for sp in params for t in (sp.sharded, sp.unsharded)}
    named = module.named_parameters(remove_duplicate=False)
    # a checkpoint_wrapper under ``module`` drops its prefix from state-dict keys (as its own
    # named_parameters does); a list group's ancestor module would keep it
    return [(state_name(n), by_id[id(p)]) for n, p in named if id(p) in by_id]


# -- model.state_dict() and model.load_state_dict() -------------------------------------------
def install_state_dict_hooks(module: nn.Module) -> None:
    """Make ``module.state_dict()`` return :class:`PieceTensor` entries for its group's parameters
    and ``module.load_state_dict()`` take them (or full tensors) back into the local pieces."""
    module.register_state_dict_post_hook(_state_dict_post_hook)
    module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)


def _state_dict_post_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
) -> None:
    """Replace each of the group's entries (the local piece, or the gathered view after a forward
    with ``reshard_after_forward=False``) by a :class:`PieceTensor` of its global shape."""
    st = state_of(module)
    if st is not None and (fq := frozen_buffers(st)) is not None:  # [Note: quantized state dicts]
        quantized_entries(module, fq, state_dict, prefix)
    if st is None or st.buffers.layout is None:
        return
    made: dict[int, PieceTensor] = {}
    for name, sp in _names(module, st.buffers.params):
        key = prefix + name
        if key in state_dict:
            if id(sp) not in made:
                # a master in packed tile order: its tiles' boxes; a TP piece: its place in the global tensor
                made[id(sp)] = param_entry(sp, sp.sharded.detach(), key, st.buffers.process_group)
            state_dict[key] = made[id(sp)]


def _load_state_dict_pre_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any], *args: Any
) -> None:
    """Turn each of the group's entries into this rank's piece with its block shape, which
    ``nn.Module`` then copies into the sharded parameter. The group is resharded first (as FSDP2
    does), so a gathered copy never outlives the values it was gathered from."""
    st = state_of(module)
    fq = frozen_buffers(st) if st is not None else None
    if st is None or (st.buffers.layout is None and fq is None):
        return
    assign = bool(local_metadata.get("assign_to_params_buffers"))
    if assign and fq is not None:
        raise ShardingError(
            f"load_state_dict(..., assign=True) on the sharded {st.buffers.name}, which holds quantized weights: "
            "assigning them is not supported. Fix: load with assign=False (the default)"
        )
    st.buffers.reshard()
    if fq is not None:  # [Note: quantized state dicts]; args: strict, missing_keys, ...
        fq.reshard()
        load_quantized(module, fq, state_dict, prefix, args[1])
    load_pieces(module, st.buffers, state_dict, prefix, assign=assign)


def load_pieces(
    module: nn.Module, group: ParamBuffers, state_dict: dict[str, Any], prefix: str, *, assign: bool
) -> None:
    """Turn the entries of ``group``'s parameters into this rank's pieces, which ``nn.Module``
    then copies into the sharded parameters. ``assign=True`` (FSDP2 code loading a meta-device
    model, [Note: meta init]): a group still on the meta device is materialized on the entries'
    device, the pieces are copied in here and each entry becomes the engine's own sharded
    parameter, so ``nn.Module``'s assignment keeps the parameters the engine gathers."""
    entries = [(prefix + name, sp) for name, sp in _names(module, group.params) if prefix + name in state_dict]
    if assign and entries and group.device.type == "meta":
        value = next((v for k, _ in entries if isinstance(v := state_dict[k], torch.Tensor)), None)
        if value is not None and value.device.type != "meta":
            group.materialize(value.device)
    for key, sp in entries:
        piece = _local_piece(key, sp, state_dict[key])
        if assign and isinstance(piece, torch.Tensor):
            with torch.no_grad():
                sp.sharded.copy_(piece)
            piece = sp.sharded
        state_dict[key] = piece


def _local_piece(name: str, sp: ShardedParam, value: object) -> object:
    """This rank's piece of a state-dict entry for ``sp``: a :class:`PieceTensor` of the same piece
    or a full tensor of the parameter's shape."""
    lo, hi = sp.local_start, sp.local_start + sp.local_numel
    if not isinstance(value, torch.Tensor):
        return value  # nn.Module reports the type
    if tuple(value.shape) != sp.entry_shape:
        local = (
            " (this rank's local piece, not the whole tensor)" if tuple(value.shape) == tuple(sp.sharded.shape) else ""
        )
        raise ShardingError(
            f"parameter {name!r}: the state dict holds shape {tuple(value.shape)}{local}, the model's parameter "
            f"has shape {sp.entry_shape}. Fix: load a state dict of this model: model.state_dict() entries through "
            "torch.distributed.checkpoint, or full tensors (blockshard.full_state_dict, an unsharded model's)"
        )
    # a master in packed tile order; a TP piece ([Note: tensor-parallel parameters])
    if isinstance(value, PieceTensor) and (sp.order is not None or sp.tp is not None):
        if [(b.offsets, b.sizes) for b in value.boxes] != [tuple(x) for x in sp.entry_boxes() or ()]:
            raise ShardingError(
                f"parameter {name!r}: the state dict holds other boxes of it than this rank's tiles or TP piece "
                "(another world size, semantics, tile_placement or TP plan). Fix: load it through "
                "torch.distributed.checkpoint (dcp.save, then dcp.load(model.state_dict(), ...)), which moves "
                "pieces between ranks, or pass full tensors"
            )
        return sp.from_boxed(value.to_local())
    if isinstance(value, PieceTensor):
        if not value.is_run or (value.local_start, value.to_local().numel()) != (lo, sp.local_numel):
            raise ShardingError(
                f"parameter {name!r}: the state dict holds piece [{value.local_start}, "
                f"{value.local_start + value.to_local().numel()}) of it, this rank holds [{lo}, {hi}) (another "
                "world size or semantics). Fix: load it through torch.distributed.checkpoint (dcp.save, then "
                "dcp.load(model.state_dict(), ...)), which moves pieces between ranks, or pass full tensors"
            )
        return value.to_local().view(sp.sharded.shape)
    return sp.piece_of_full(value.detach())


def _entries(model: nn.Module, state: Mapping[str, _V]) -> Iterator[tuple[str, ShardedParam, _V]]:
    """``(name, sharded param, saved entry)`` for every parameter of every group under ``model``."""
    for prefix, st in states_under(model):
        for sp in st.buffers.params:
            name = join_name(prefix, sp.fqn)
            if name not in state:
                raise ShardingError(f"state has no entry for parameter {name!r}; it was saved from another model")
            yield name, sp, state[name]


def _load_quantized(model: nn.Module, state: Mapping[str, Any], *, full: bool) -> None:
    """Every group's frozen quantized bytes from ``state`` ([Note: quantized state dicts]); groups
    are resharded first, so no gathered copy outlives the bytes it was gathered from."""
    if not full:  # LocalShards as (values, start, global shape, order)
        state = {
            k: (v.tensor, v.start, tuple(v.global_shape), v.order) if isinstance(v, LocalShard) else v
            for k, v in state.items()
        }
    for prefix, st in states_under(model):
        qg = frozen_buffers(st)
        if qg is None:
            continue
        st.buffers.reshard()
        qg.reshard()
        load_quantized_pieces(st.module, qg, state, join_name(prefix, ""), full=full)


@torch.no_grad()
def load_sharded_state_dict(model: nn.Module, state: Mapping[str, LocalShard]) -> None:
    """Copy local pieces saved by :func:`sharded_state_dict` back (same world size and layout)."""
    checkpoint_states(model, "load_sharded_state_dict")  # LocalShards of TP parameters: refused
    for name, sp, shard in _entries(model, state):
        order = sp.order.name if sp.order is not None else "row-major"
        mine = (sp.local_start, sp.local_numel, sp.shape, order)
        if (shard.start, shard.tensor.numel(), tuple(shard.global_shape), shard.order) != mine:
            raise ShardingError(
                f"parameter {name!r}: saved piece [{shard.start}, {shard.start + shard.tensor.numel()}) of "
                f"{tuple(shard.global_shape)} does not match this rank's piece [{sp.local_start}, "
                f"{sp.local_start + sp.local_numel}) of {sp.shape}: the layout changed (another world size "
                "or semantics). Fix: load a full state dict with load_full_state_dict instead"
            )
        sp.sharded.copy_(shard.tensor.view(sp.sharded.shape))
    _load_quantized(model, state, full=False)


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy full tensors (by name, as :func:`full_state_dict` gives them) into the local pieces,
    at any world size; quantized weights from the unsharded model's entries."""
    for name, sp, full in _entries(model, state):
        if tuple(full.shape) != sp.entry_shape:
            raise ShardingError(f"parameter {name!r}: saved shape {tuple(full.shape)} != model shape {sp.entry_shape}")
        sp.sharded.copy_(sp.piece_of_full(full))
    _load_quantized(model, state, full=True)


def gather_pieces(state: Any, *, keep: bool = True) -> Any:
    """``state`` (nested dicts, lists, tuples) with every :class:`PieceTensor` replaced by its full
    tensor (collective: every rank passes the same PieceTensor entries, checked first, so a
    mismatch raises on every rank instead of pairing the wrong collectives). One tensor at a time;
    a PieceTensor under several names (tied parameters) becomes one tensor; ``keep=False`` gathers
    and drops each (``None``), for ranks that return nothing."""
    _check_same_pieces(list(_leaves(state)))
    memo: dict[int, torch.Tensor | None] = {}

    def full(value: Any) -> Any:
        if not isinstance(value, PieceTensor):
            return value
        if id(value) not in memo:
            whole = value.full_tensor()  # collective: every rank gathers, only keepers hold it
            memo[id(value)] = whole if keep else None
        return memo[id(value)]

    return _map(state, full)


def _leaves(state: Any, path: str = "") -> Iterator[tuple[str, PieceTensor]]:
    """``(path, PieceTensor)`` for every PieceTensor in ``state``, in traversal order."""
    if isinstance(state, PieceTensor):
        yield path, state
    elif isinstance(state, Mapping):
        for k, v in state.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from _leaves(v, f"{path}.{i}" if path else str(i))


def _map(state: Any, fn: Any) -> Any:
    if isinstance(state, Mapping) and not isinstance(state, PieceTensor):
        return {k: _map(v, fn) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_map(v, fn) for v in state)
    return fn(state)


def _check_same_pieces(pieces: list[tuple[str, PieceTensor]]) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    agree_call(None, "gathering full tensors (gather_pieces)")  # [Note: collective headers]
    mine = [(path, tuple(p.shape), str(p.dtype)) for path, p in pieces]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for r, theirs in enumerate(every):
        if theirs != mine:
            diff = next((a, b) for a, b in itertools.zip_longest(mine, theirs) if a != b)
            raise ShardingError(
                f"gathering full tensors: rank {dist.get_rank()}'s state dict holds the sharded entry {diff[0]}, "
                f"rank {r}'s holds {diff[1]} at the same place ({len(mine)} vs {len(theirs)} sharded entries). "
                "Fix: call it on every rank with the same model and optimizers (every rank's optimizer over the "
                "same parameters, or blockshard.optimizer_state_dict)"
            )
