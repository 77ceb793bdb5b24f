"""``blockshard.clip_grad_norm_``: the global gradient norm of a sharded model, clipped alike on every rank.

[Note: clipping]
On the ragged engine a sharded parameter is a plain tensor viewing the rank's piece, and so is its
``.grad``. ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` therefore returns the norm
of *this rank's pieces* and every rank clips by a different factor (measured on a tiny Llama at
W = 2: 0.806 on rank 0 against the true 1.320); under FSDP2 the same call is right because each
DTensor gradient reduces its norm. This function computes the norm of the *whole* gradients:

  1. per process group, the rank's local sum of p-th powers of its pieces' norms (the max for
     p = inf), empty pieces contributing nothing;
  2. one ``all_reduce`` per process group (SUM; MAX for inf);
  3. gradients of parameters outside every sharded group (replicated: every rank holds the
     whole tensor) are added once, not W times: they are taken to be equal on every rank;
  4. ``torch.nn.utils.clip_grads_with_norm_`` with that total norm, so every rank scales by the
     same factor and the scaling is torch's own arithmetic.

The total is the same tensor value on every rank. It equals the one-process norm up to the
summation order of step 1-2 (a few float32 ulps; bitwise for p = inf, where max is exact). Where
every group is one rank, there is nothing to sum across ranks, and the total is torch's own
``get_total_norm``, bitwise.

How torch's own call is made right: ``fully_shard`` installs the torch route of
``clip_grad_norm_`` (routes/_clip.py, [Note: torch routes]): torch's function, however early bound,
calls this function when any parameter is a sharded piece (same arguments, same result on every
rank) and torch's implementation otherwise. The cost is one attribute read per parameter per
call (well under 1 us per parameter: about 30 us for a 300-parameter model against the norm's
own ms). With the route off (``BLOCKSHARD_TORCH_ROUTES``), call this function yourself.

Why not a ``.grad`` tensor subclass whose ``__torch_function__`` turns the norm of local pieces
into a global one: it works (every optimizer test stays bitwise), but every operation any
optimizer runs on a gradient then passes through Python: +6 to +9% on torch AdamW's default CPU
step (single-tensor path) at W = 2, beyond the 5% allowed. See docs/engine.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

from blockshard._errors import ClipError
from blockshard.runtime.core._collectives import agree, all_reduce_in_place
from blockshard.runtime.core._common import ShardedState
from blockshard.runtime.core._param import ShardedParam, managed_tag
from blockshard.runtime.core._state import state_of

__all__ = ["ClipError", "clip_grad_norm_"]


def _norm_type(norm_type: object) -> float:
    try:
        p = float(norm_type)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        p = math.nan
    if isinstance(norm_type, bool) or not (p > 0):  # nan, 0, negative, -inf
        raise ClipError(
            f"norm_type={norm_type!r} is not a p-norm that can clip: it must be a number > 0 or inf "
            "(2.0, 1.0 and float('inf') are the usual ones). Fix: pass e.g. norm_type=2.0"
        )
    return p


def _max_norm(max_norm: object) -> float:
    try:
        value = float(max_norm)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(max_norm, bool) or not value >= 0:
        raise ClipError(f"max_norm={max_norm!r} must be a number >= 0. Fix: pass e.g. max_norm=1.0")
    return value


Route = tuple[dist.ProcessGroup, ...]  # the groups a piece's norm is summed over (empty: replicated)


def _route(group: Any, sp: ShardedParam) -> Route:
    """The groups a piece's norm is summed over: the one it is sharded over, and tp for a piece of
    a TP-sharded parameter ([Note: tensor-parallel parameters])."""
    pg = cast(dist.ProcessGroup, group.process_group)
    tp = sp.tp
    return (pg, tp.group) if tp is not None and tp.cut else (pg,)


def _pieces_of(model: nn.Module) -> dict[int, Route]:
    """``id(piece) -> route`` for every sharded parameter under ``model``."""
    out: dict[int, Route] = {}
    for m in model.modules():
        st = state_of(m)
        if st is None:
            continue
        for group in st.param_buffers:  # every buffer set of parameters ([Note: buffer sets])
            if group.sharded_state is not ShardedState.SHARDED:
                raise ClipError(
                    f"group {group.name!r} is {group.sharded_state.name} (it holds its full parameters), so its "
                    "gradients are not reduced yet. Fix: clip after loss.backward() has finished, before "
                    "optimizer.step()"
                )
            for sp in group.params:
                out[id(sp.sharded)] = _route(group, sp)
    return out


def _tagged_route(p: torch.Tensor, pg: dist.ProcessGroup, group_ref: object) -> Route:
    """The route of a local piece passed on its own: its tag names its process group and group."""
    group = group_ref() if callable(group_ref) else None
    sp = next((q for q in getattr(group, "params", ()) if q.sharded is p), None)
    return _route(group, sp) if group is not None and sp is not None else (pg,)


def _resolve(
    parameters_or_model: nn.Module | torch.Tensor | Iterable[torch.Tensor],
) -> tuple[list[torch.Tensor], list[Route]]:
    """The parameters, and for each the process groups its norm is summed over (none: replicated)."""
    if isinstance(parameters_or_model, nn.Module):
        pieces = _pieces_of(parameters_or_model)
        params: list[torch.Tensor] = list(parameters_or_model.parameters())
    else:
        pieces = {}
        params = [parameters_or_model] if isinstance(parameters_or_model, torch.Tensor) else list(parameters_or_model)
    groups: list[Route] = []
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise ClipError(
                f"parameters[{i}] is a {type(p).__name__}, not a tensor. Fix: pass the model or model.parameters()"
            )
        tag = managed_tag(p) if isinstance(p, nn.Parameter) else None
        if id(p) in pieces:
            groups.append(pieces[id(p)])
        elif tag is None:
            groups.append(())  # replicated: not managed by the engine
        elif isinstance(parameters_or_model, nn.Module) or tag.original or tag.process_group is None:
            raise ClipError(_unknown_piece(i, tuple(p.shape), tag.group_name, tag.original))
        else:  # a local piece: its tag names the process group it is sharded over
            groups.append(_tagged_route(p, cast(dist.ProcessGroup, tag.process_group), tag.group))
    return params, groups


def _unknown_piece(i: int, shape: tuple[int, ...], group_name: str, original: bool) -> str:
    if original:
        return (
            f"parameters[{i}] (shape {shape}) is a parameter that fully_shard replaced (group of a {group_name}): "
            "it no longer trains. Fix: pass the sharded model, or model.parameters() taken after fully_shard"
        )
    return (
        f"parameters[{i}] (shape {shape}) is a full parameter view of a group of a {group_name}, held while the group "
        "is unsharded. Fix: clip after loss.backward() has finished, before optimizer.step()"
    )


def _tensor_norms(grads: list[torch.Tensor], p: float, foreach: bool | None) -> list[torch.Tensor]:
    """Each tensor's p-norm, as torch's ``_get_total_norm`` computes them (empty ones left out)."""
    grads = [g for g in grads if g.numel()]
    norms: list[torch.Tensor] = []
    if not grads:  # every piece here is empty (torch's grouping refuses an empty list)
        return norms
    grouped = _group_tensors_by_device_and_dtype([grads])  # type: ignore[list-item]
    for (device, _), ([maybe_grads], _) in grouped.items():
        device_grads = [g for g in maybe_grads if g is not None]  # all are: None never went in
        if (foreach is None and _has_foreach_support(device_grads, device)) or (
            foreach and _device_has_foreach_support(device)
        ):
            norms.extend(torch._foreach_norm(device_grads, p))
        elif foreach:
            raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
        else:
            norms.extend(torch.linalg.vector_norm(g, p) for g in device_grads)
    return norms


def _partial(norms: list[torch.Tensor], p: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The sum of the norms' p-th powers (their max for inf), 0 when there are none."""
    if not norms:
        return torch.zeros((), dtype=dtype, device=device)
    stacked = torch.stack([n.to(device=device, dtype=dtype) for n in norms])
    return stacked.max() if math.isinf(p) else stacked.pow(p).sum()


@torch.no_grad()
def clip_grad_norm_(
    parameters_or_model: nn.Module | torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of a sharded model by their global norm; return that norm (every rank alike).

    ``torch.nn.utils.clip_grad_norm_`` for blockshard's ragged engine, with the same arguments and
    arithmetic ([Note: clipping]). Call it on every rank, after ``backward()`` and before
    ``optimizer.step()``: it runs one ``all_reduce`` per process group.

    ``parameters_or_model``: the model, or its parameters (``model.parameters()``, an optimizer's
    ``param_group["params"]``); each local piece carries the process group it is sharded over.
    Parameters outside every sharded group are counted once: their gradients must be the same on
    every rank (as under data parallelism), else each rank gets its own total. ``norm_type``: any
    p > 0, or ``float('inf')``.
    """
    p, max_norm = _norm_type(norm_type), _max_norm(max_norm)
    params, groups = _resolve(parameters_or_model)
    if all(dist.get_world_size(pg) == 1 for route in groups for pg in route):
        # [Note: one rank] every group is one rank: nothing to sum across ranks, so torch's own total
        # norm over the gradients in parameter order, bitwise (the general sum of powers below can
        # differ from it by an ulp, as a reduction's order does)
        grads = [param.grad for param in params if param.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, p, error_if_nonfinite, foreach)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
        return total
    by_group: dict[tuple[int, ...], tuple[Route, torch.device, list[torch.Tensor]]] = {}
    for param, route in zip(params, groups, strict=True):
        key = tuple(id(pg) for pg in route)
        entry = by_group.setdefault(key, (route, param.device, []))  # first-seen order: same on every rank
        if param.grad is not None:
            entry[2].append(param.grad)
    grads = [g for _, _, gs in by_group.values() for g in gs]
    if not grads and all(not route for route, _, _ in by_group.values()):
        return torch.tensor(0.0)  # what torch returns for no gradients (no collective: nothing is sharded)
    dtypes = [g.dtype for g in grads] or [torch.float32]
    out_dtype = functools.reduce(torch.promote_types, dtypes)
    acc_dtype = torch.promote_types(out_dtype, torch.float32)  # the cross-rank sum in float32 at least
    device = grads[0].device if grads else params[0].device
    parts = []
    for route, pg_device, pg_grads in by_group.values():
        part = _partial(_tensor_norms(pg_grads, p, foreach), p, pg_device, acc_dtype)
        for pg in route:  # the dp group, then tp for a TP-sharded piece ([Note: tensor-parallel parameters])
            op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
            agree(pg, "the gradient-norm all-reduce (clip_grad_norm_)", numel=part.numel(), dtype=part.dtype)
            all_reduce_in_place(part, op, pg, "the gradient-norm all-reduce")
        parts.append(part.to(device))
    stacked = torch.stack(parts)
    total = (stacked.max() if math.isinf(p) else stacked.sum().pow(1.0 / p)).to(out_dtype)
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, so it cannot be clipped. "
            "To disable this error and scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total
