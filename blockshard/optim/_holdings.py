"""The ragged engine's parameters as owner-compute sees them (:class:`Holding`), with the checks of
what a user passes: the pieces current, their names their own, the process group a process group."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from blockshard.optim._owner_compute import Holding, NamedGroups, OwnerComputeError
from blockshard.runtime.core._owners import tensor_owner_plan
from blockshard.runtime.core._param import managed_tag
from blockshard.semantics import TensorSpec, fused_parts
from blockshard.semantics._experts import is_stacked_experts

__all__ = ["process_group_of", "ragged_holdings"]


def ragged_holdings(groups: NamedGroups, mtypes: Mapping[int, str] | None = None) -> tuple[list[Holding], Any]:
    """Every parameter as a :class:`Holding`: owner-computed where the engine's owner plan cuts it."""

    holdings: list[Holding] = []
    process_group = None
    seen: dict[int, str] = {}
    for gi, (_, named) in enumerate(groups):
        for name, p in named:
            if id(p) in seen:
                raise OwnerComputeError(f"parameter {name!r} is the same tensor as {seen[id(p)]!r}; pass each once")
            seen[id(p)] = name
            tag = managed_tag(p)
            if tag is not None and tag.original:
                raise OwnerComputeError(
                    f"parameter {name!r} of shape {tuple(p.shape)} was replaced by fully_shard (in the group of a "
                    f"{tag.group_name}); build the optimizer after the last fully_shard, over model.named_parameters()"
                )
            ref = tag.group if tag is not None else None
            group: Any = ref() if callable(ref) else None
            if tag is None or group is None:  # not sharded by the ragged engine: stepped as it is
                holdings.append(
                    Holding(
                        name,
                        p,
                        tuple(p.shape),
                        gi,
                        direct=True,
                        matrix_numel=_expert_numel(name, p, (mtypes or {}).get(id(p))),
                    )
                )
                continue
            process_group = process_group if process_group is not None else tag.process_group
            sp = next((sp for sp in group.params if sp.sharded is p), None)
            if sp is None:
                raise OwnerComputeError(
                    f"parameter {name!r} is not a current local piece of its group {group.name!r} (taken during "
                    "forward, or before the group was rebalanced); build the optimizer after the last "
                    "fully_shard, outside forward/backward, over model.named_parameters()"
                )
            _check_name(name, sp, group.name)
            tp = sp.tp if sp.tp is not None and sp.tp.cuts_matrices(len(sp.shape)) else None
            plan = tensor_owner_plan(group, sp.fqn, name)
            placed = group.layout.tensors[sp.index]
            grid = plan.compute if plan is not None else placed.grid
            parts = fused_parts(placed.semantics)
            mn = math.prod(sp.shape[-2:]) if len(sp.shape) >= 3 else 0
            matrix_numel = mn if mn and grid.unit_numel == mn else 0  # stacked experts: one matrix each
            common: dict[str, Any] = {
                "local_start": sp.local_start,
                "local_numel": sp.local_numel,
                "direct": True,
                "matrix_numel": matrix_numel,
                "tp": tp,
                "parts": parts,
            }
            if plan is None or not plan.units:
                S = group.layout.buckets[placed.bucket]
                cuts = tuple(k * S - placed.offset for k in range(placed.offset // S + 1, -(-placed.end // S)))
                holdings.append(
                    Holding(name, p, tuple(sp.shape), gi, cuts=cuts, **common)
                )  # cuts: the same on every rank
                continue
            holdings.append(
                Holding(
                    name,
                    p,
                    tuple(sp.shape),
                    gi,
                    planned=True,
                    offset=plan.offset,
                    segment=plan.segment_numel,
                    units=plan.units,
                    **common,
                )
            )
    return holdings, process_group


def process_group_of(given: object, found: Any) -> Any:
    """``process_group=`` if given (checked), else the one the parameters' group was sharded over."""
    if given is None:
        return found
    if not isinstance(given, dist.ProcessGroup):
        raise OwnerComputeError(
            f"process_group={given!r} is a {type(given).__name__}, not a torch.distributed.ProcessGroup. Fix: pass "
            "the group the model was sharded over (fully_shard's mesh group), or None to take it from the parameters"
        )
    return given


def _expert_numel(name: str, p: torch.Tensor, module_type: str | None) -> int:
    """``m * n`` for a stacked ``(E, m, n)`` expert tensor the engine does not shard, as [Note: stacked
    experts] recognises one (its module's class, when ``params`` was a module, or its name); else 0."""
    spec = TensorSpec(name=name, shape=tuple(p.shape), dtype="float32", module_type=module_type)
    if p.ndim < 3 or not is_stacked_experts(spec):
        return 0
    return math.prod(p.shape[-2:])


def _check_name(name: str, sp: Any, group_name: str) -> None:
    """The name a ``param_group`` gives a piece must be its own: ``sp.fqn`` (relative to the sharded
    module) at the end of it, or, for a tied weight, one of the attributes it is registered as."""
    if name == sp.fqn or name.endswith("." + sp.fqn):
        return
    if len(sp.refs) > 1 and name.rpartition(".")[2] in {r.attr for r in sp.refs}:
        return
    raise OwnerComputeError(
        f"parameter {name!r} (a piece of shape {tuple(sp.sharded.shape)}) is the piece of {sp.fqn!r} (global shape "
        f"{sp.shape}) in the group of a {group_name}: its param_names entry names another tensor. Fix: take names "
        "and parameters together, from model.named_parameters() or blockshard.optim.muon_param_groups(model), "
        "called after the last fully_shard"
    )
