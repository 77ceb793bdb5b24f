"""torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` for a blockshard model
([Note: torch's state-dict helpers] in ``_state_dict.py``): :func:`optimizer_state_dict` and
:func:`load_optimizer_state_dict` of ``_optim_state.py`` in torch's layouts (full state dicts
gathered from the pieces, flattened, broadcast from rank 0, bitsandbytes' nested 8-bit state).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from blockshard._errors import CheckpointError
from blockshard.runtime.checkpoint._optim_codecs import _pg
from blockshard.runtime.checkpoint._optim_state import _by_param, load_optimizer_state_dict, optimizer_state_dict
from blockshard.runtime.checkpoint._piece_tensor import PieceTensor, entry_group
from blockshard.runtime.checkpoint._state_dict import gather_pieces
from blockshard.runtime.core._collectives import agree_call
from blockshard.runtime.core._inspect import state_name as _name
from blockshard.runtime.core._inspect import states_under
from blockshard.runtime.core._param import ShardedParam

__all__ = ["torch_load_optimizer_state_dict", "torch_optimizer_state_dict"]


@dataclass(frozen=True)
class _PieceSpec:
    """A PieceTensor entry as another rank describes it (global shape and dtype)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def torch_optimizer_state_dict(
    model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], info: Any, *, keep: bool
) -> dict[str, Any]:
    """What ``get_optimizer_state_dict`` returns for a blockshard model: every optimizer's
    :func:`optimizer_state_dict` (state by name, ``param_groups`` in order), under
    ``full_state_dict=True`` with every PieceTensor gathered (only rank 0 keeps the values with
    ``cpu_offload``; the others return ``{}``, as torch), then torch's own flattening and offload."""
    import torch.distributed.checkpoint.state_dict as dsd

    osd: dict[str, Any] = {"state": {}, "param_groups": []}
    for o in optimizers:
        one = optimizer_state_dict(model, o)
        osd["state"].update({n: _bnb_nested(o, entries) for n, entries in one["state"].items()})
        osd["param_groups"] += one["param_groups"]
    if info.full_state_dict:
        osd = gather_pieces(_with_every_rank_state(model, osd), keep=keep)
        if not keep:
            return {}
    if info.flatten_optimizer_state_dict:
        osd = dsd._flatten_optim_state_dict(osd)
    return dsd._maybe_full_or_cpu_state_dict(osd, info)


def _with_every_rank_state(model: nn.Module, osd: dict[str, Any]) -> dict[str, Any]:
    """``osd`` holding the state of every parameter any rank's optimizer holds, in the model's
    order, so that every rank gathers the same tensors: a rank that holds no element of a
    parameter (its optimizer left it out or holds its empty piece, which holds no state: [Note:
    empty pieces hold no state]) gets its entries as empty pieces (collective)."""
    import torch.distributed as dist

    state, pg = osd["state"], _process_group(model)
    if pg is not None and dist.get_world_size(pg) > 1:
        agree_call(pg, "torch's get_optimizer_state_dict on a blockshard model")  # [Note: collective headers]
        names: list[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(names, sorted(state), group=pg)
        held = [set(n) for n in names]
        union = set().union(*held)
        if any(h != union for h in held):
            shared: list[Any] = [None] * len(held)
            specs = {n: _spec(state[n]) for n in state if any(n not in h for h in held)}
            dist.all_gather_object(shared, specs, group=pg)
            sps = dict(_by_param(model).values())
            for n in union - set(state):
                state[n] = _empty_pieces(next(s[n] for s in shared if n in s), n, sps[n])
    order = {_name(n): i for i, (n, _) in enumerate(model.named_parameters())}
    osd["state"] = {n: state[n] for n in sorted(state, key=lambda n: (order.get(n, len(order)), n))}
    return osd


def _process_group(model: nn.Module) -> Any:
    import torch.distributed as dist

    states = states_under(model)
    return states[0][1].buffers.process_group if states and dist.is_initialized() else None


def _spec(entries: Any) -> Any:
    if isinstance(entries, PieceTensor):
        return _PieceSpec(tuple(entries.shape), entries.dtype)
    if isinstance(entries, Mapping):
        return {k: _spec(v) for k, v in entries.items()}
    return entries


def _empty_pieces(spec: Any, name: str, sp: ShardedParam | None) -> Any:
    if isinstance(spec, _PieceSpec):
        assert sp is not None, f"{name}: a piece of a parameter outside any group"
        empty = torch.empty(0, dtype=spec.dtype, device=sp.sharded.device)
        return PieceTensor(empty, 0, spec.shape, name=name, process_group=entry_group(sp, _pg(sp)))
    if isinstance(spec, Mapping):
        return {k: _empty_pieces(v, name, sp) for k, v in spec.items()}
    return spec


def torch_load_optimizer_state_dict(
    model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], state_dict: dict[str, Any], info: Any
) -> None:
    """What ``set_optimizer_state_dict`` does for a blockshard model: each optimizer takes its
    ``param_groups`` (in order) and its parameters' state by name, from a sharded state dict
    (PieceTensors, e.g. filled by ``dcp.load``), a full one (each rank copies its piece out of
    the full tensors) or torch's flattened form, through :func:`load_optimizer_state_dict`."""

    if info.broadcast_from_rank0:
        state_dict = _from_rank0(model, optimizers, state_dict)
    total, offset = sum(len(o.param_groups) for o in optimizers), 0
    for o in optimizers:
        template = optimizer_state_dict(model, o)  # collective; creates missing state
        if "state" in state_dict:
            groups = state_dict["param_groups"]
            if len(groups) != total:
                raise CheckpointError(
                    f"the optimizer state dict has {len(groups)} param_groups, the optimizers passed have {total}. "
                    "Fix: load the state dict of the same optimizers, passed in the same order"
                )
            mine = {"state": state_dict["state"], "param_groups": groups[offset : offset + len(o.param_groups)]}
        else:
            mine = _unflatten(state_dict, template)
        offset += len(o.param_groups)
        missing = [n for n in template["state"] if n not in mine["state"]]
        if missing and info.strict:
            raise CheckpointError(
                f"the optimizer state dict has no state for parameters {missing[:5]} ({len(missing)} in all) that "
                "this optimizer holds state for. Fix: load the state dict of this model's optimizer, or pass "
                "StateDictOptions(strict=False)"
            )
        state = {
            n: _as_pieces(n, template["state"][n], _bnb_flat(v))
            for n, v in mine["state"].items()
            if n in template["state"]
        }
        load_optimizer_state_dict(model, o, {"state": state, "param_groups": mine["param_groups"]})


# bitsandbytes (>= 0.49) ``Optimizer8bit.state_dict`` nests a parameter's quantization state
# (``state1``, ``absmax1``, ``qmap1``, ...) under this key; torch's helpers give an unsharded model's
# state in that layout, so they give a blockshard model's in it too.
_BNB_NESTED = "__bnb_optimizer_quant_state__"


def _bnb_nested(optimizer: torch.optim.Optimizer, entries: dict[str, Any]) -> dict[str, Any]:
    if getattr(type(optimizer), "_FSDP_WRAPPED_QUANT_STATE_KEY", None) != _BNB_NESTED:
        return entries  # not bitsandbytes, or a version that does not nest
    keys = optimizer.non_castable_tensor_keys  # type: ignore[attr-defined]
    quant = {k: v for k, v in entries.items() if k in keys}
    return {k: v for k, v in entries.items() if k not in keys} | ({_BNB_NESTED: quant} if quant else {})


def _bnb_flat(entries: Any) -> Any:
    """A parameter's state with bitsandbytes' nested quantization state (either layout) flat."""
    if not isinstance(entries, Mapping) or not isinstance(entries.get(_BNB_NESTED), Mapping):
        return entries
    return {k: v for k, v in entries.items() if k != _BNB_NESTED} | dict(entries[_BNB_NESTED])


def _from_rank0(
    model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], state_dict: dict[str, Any]
) -> dict[str, Any]:
    """Rank 0's full optimizer state dict on every rank, as far as each rank's optimizers hold it:
    torch's broadcast (one tensor at a time) into this rank's entries, the names every rank's
    ``param_groups`` list kept (collective)."""
    import torch.distributed as dist
    from torch.distributed._state_dict_utils import _broadcast_state_dict, _flatten_state_dict, _unflatten_state_dict

    local: dict[str, Any] = {"state": {}, "param_groups": []}
    for o in optimizers:
        one = optimizer_state_dict(model, o)
        local["state"].update({n: _bnb_nested(o, entries) for n, entries in one["state"].items()})
        local["param_groups"] += one["param_groups"]
    names = [g["params"] for g in local["param_groups"]]
    flat, mapping = _flatten_state_dict(local)
    full = _flatten_state_dict(state_dict)[0] if dist.get_rank() == 0 else {}
    device = states_under(model)[0][1].buffers.local.device
    _broadcast_state_dict(full, flat, device=device)
    out = _unflatten_state_dict(flat, mapping)
    out.setdefault("state", {})  # a rank that holds no state (only empty pieces) flattened none
    for g, params in zip(out["param_groups"], names, strict=True):
        g["params"] = params
    return out


def _unflatten(flat: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """torch's flattened optimizer state dict (``state.NAME.KEY``, ``param_groups.NAME.KEY``) as
    ``{"state": ..., "param_groups": ...}`` for the optimizer ``template`` describes."""

    state: dict[str, Any] = {}
    for name in template["state"]:
        prefix = f"state.{name}."
        for key, value in flat.items():
            if key.startswith(prefix):
                *outer, last = key[len(prefix) :].split(".")
                node = state.setdefault(name, {})
                for part in outer:
                    node = node.setdefault(part, {})
                node[last] = value
    groups = []
    for g in template["param_groups"]:
        first = next((n for n in g["params"] if f"param_groups.{n}.lr" in flat), None)
        if first is None and g["params"]:
            raise CheckpointError(
                f"the flattened optimizer state dict has no param_groups entries for {g['params'][:3]}. Fix: load "
                "the state dict of this model's optimizer"
            )
        saved = {k: flat[f"param_groups.{first}.{k}"] for k in g if k != "params" and first is not None}
        groups.append({k: v for k, v in g.items() if k != "params"} | saved | {"params": g["params"]})
    return {"state": state, "param_groups": groups}


def _as_pieces(name: str, template: Any, value: Any) -> Any:
    """``value`` with each full tensor where ``template`` holds a PieceTensor replaced by this
    rank's piece of it (a PieceTensor of the template's place); everything else as it is."""

    if isinstance(template, Mapping) and isinstance(value, Mapping):
        return {k: _as_pieces(name, template.get(k), v) for k, v in value.items()}
    if not isinstance(template, PieceTensor) or not isinstance(value, torch.Tensor) or isinstance(value, PieceTensor):
        return value
    if tuple(value.shape) != tuple(template.shape):
        raise CheckpointError(
            f"optimizer state of parameter {name!r}: the state dict holds shape {tuple(value.shape)}, the optimizer's "
            f"state has shape {tuple(template.shape)}. Fix: load the state dict of this model's optimizer"
        )
    if value.dtype != template.dtype and not (value.is_floating_point() and template.is_floating_point()):
        raise CheckpointError(
            f"optimizer state of parameter {name!r}: the state dict holds {value.dtype}, the optimizer's state is "
            f"{template.dtype} (e.g. 8-bit state saved, 32-bit state here). Fix: load the state dict of this "
            "optimizer"
        )
    piece = template._piece_of(value).to(device=template.device, dtype=template.dtype)  # a run, or its boxes
    return template._like(piece)
