"""Owner-compute on FSDP2's element-wise shards: the adapter's half of [Note: owner compute].

FSDP2 (``Shard(0)``) gives rank ``r`` rows ``[r*c, (r+1)*c)`` of every parameter: in the terms of
``blockshard/optim/_owner_compute.py``, ``offset = 0`` and ``S = c * row_numel``. Each unit that
straddles rank boundaries gets one **owner** (:func:`blockshard.planner.plan_owners` with
``engine="fsdp2"`` on the parameters' full shapes, balancing Newton-Schulz cost; every rank computes
the same plan). Everything else -- the exchange lists, the all_to_alls, the inner optimizer's
surface -- is :class:`blockshard.optim.OwnerComputeOptimizer`, the same implementation the ragged
engine uses; this module only reads FSDP2's DTensors and checks their placements.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from blockshard.optim._owner_compute import (
    Exchange,
    Holding,
    InnerFactory,
    NamedGroups,
    OwnedUnit,
    OwnerComputeError,
    ParamsArg,
    add_module_types,
    exchange_lists,
    named_groups,
)
from blockshard.optim._owner_optimizer import OwnerComputeOptimizer as _Core
from blockshard.planner import PlanItem, plan_owners
from blockshard.planner._owner import unit_rows
from blockshard.planner._units import ceil_div, rows_cols
from blockshard.semantics import SemanticsRules, TensorSpec, fused_parts

from ._placement import decide, dim_split_keeps_units, spec_of

if TYPE_CHECKING:
    from blockshard.planner import OwnerPlan

__all__ = ["OwnerComputeError", "OwnerComputeOptimizer", "build_exchange"]


def build_exchange(plan: OwnerPlan, rank: int, dtypes: list[str]) -> tuple[dict[str, Exchange], list[OwnedUnit]]:
    """Pure: this rank's all_to_all lists per dtype from an FSDP2 owner plan, and its owned units
    (see :func:`blockshard.optim._owner_compute.exchange_lists`); ``dtypes[t]`` names plan tensor ``t``'s dtype."""
    return exchange_lists(_plan_holdings(plan, [None] * len(plan.tensor_names)), dtypes, rank, plan.world_size)


def _plan_holdings(plan: OwnerPlan, holdings: list[Holding | None]) -> list[Holding]:
    """``holdings`` (one per plan tensor, ``None``: a stand-in) with the plan's geometry and cut units."""
    units: dict[int, list[tuple[int, int, int]]] = {}
    for t, a, n, o in unit_rows(plan):
        units.setdefault(t, []).append((a, n, o))
    out = []
    for t, q in enumerate(holdings):
        q = q if q is not None else Holding(plan.tensor_names[t], torch.empty(0), (), 0)
        q.planned, q.offset, q.segment = True, 0, max(int(plan.tensor_shard_numel[t]), 1)
        q.units = tuple(units.get(t, ()))
        out.append(q)
    return out


class OwnerComputeOptimizer(_Core):
    """Step FSDP2-sharded parameters with an unmodified optimizer that sees whole units.

    Args:
        inner_optimizer_factory: called once with a list of ``param_groups`` (``{"params": [tensors],
            **options}``) holding this rank's *compute tensors* -- views of whole units in its local
            shards and the full-unit tensors it owns -- and returns the inner optimizer (e.g.
            ``lambda groups: torch.optim.Muon(groups, lr=0.02)``). A rank may get empty ``param_groups``.
        params: ``model.named_parameters()`` (or any ``(name, param)`` pairs), a module, or a list of
            ``param_groups`` ``{"params": [(name, param), ...], **options}`` (or ``{"params": [param, ...],
            "param_names": [name, ...], ...}``, as :func:`blockshard.optim.muon_param_groups` returns);
            names are what ``semantics`` rules match (use the root model's names, as :func:`fully_shard`
            with ``root=``).
        semantics: rules as :meth:`SemanticsRules.coerce` accepts (``"matrix"`` for Muon, ``None``
            for element-wise optimizers, ``"bnb8bit"``, ...).
        process_group: the FSDP2 shard group; default: the group of the parameters' 1-D mesh.
        model: the root module, to give rules module types when ``params`` is not a module.

    Parameters may be FSDP2 ``Shard(0)`` DTensors (block-aligned: stepped locally; units split by
    ``Shard(0)``: owner-compute), ``Shard(d)`` DTensors whose units are whole, ``Replicate``
    DTensors or plain tensors (stepped locally). Gradients must be ``None`` on all ranks or on none
    (FSDP2 guarantees that). ``inner`` is the inner optimizer. :meth:`state_dict` is per rank: load
    it at the same world size and semantics. If parameter values are changed outside :meth:`step`
    (e.g. ``model.load_state_dict``), call :meth:`resync_params` (or :meth:`load_state_dict`, which
    does) on every rank.
    """

    def __init__(
        self,
        inner_optimizer_factory: InnerFactory,
        params: ParamsArg,
        *,
        semantics: object = None,
        process_group: dist.ProcessGroup | None = None,
        model: nn.Module | None = None,
    ) -> None:
        if not callable(inner_optimizer_factory):
            raise OwnerComputeError(
                f"inner_optimizer_factory={inner_optimizer_factory!r} must be callable: "
                "groups -> optimizer, e.g. lambda groups: torch.optim.Muon(groups, lr=0.02)"
            )
        rules = SemanticsRules.coerce(semantics)
        groups, mtypes = named_groups(params)
        if model is not None:
            add_module_types(mtypes, model)
        holdings: list[Holding] = []
        self._specs: list[TensorSpec] = []
        mesh: DeviceMesh | None = None
        seen: dict[int, str] = {}
        for gi, (_, named) in enumerate(groups):
            for name, p in named:
                if id(p) in seen:
                    raise OwnerComputeError(
                        f"parameter {name!r} is the same tensor as {seen[id(p)]!r}; pass each parameter once"
                    )
                seen[id(p)] = name
                spec = spec_of(name, p, mtypes.get(id(p)))
                if isinstance(p, DTensor):
                    if mesh is None:
                        mesh = p.device_mesh
                    if p.device_mesh.ndim != 1 or p.device_mesh != mesh:
                        raise OwnerComputeError(
                            f"parameter {name!r} lives on mesh {p.device_mesh}, but all DTensor parameters "
                            f"must share one 1-D mesh (first one: {mesh}); HSDP / 2-D meshes are not supported"
                        )
                holdings.append(Holding(name, p, tuple(spec.shape), gi))
                self._specs.append(spec)
        W = mesh.size() if mesh is not None else 1
        rank = mesh.get_local_rank() if mesh is not None else 0
        group = process_group if process_group is not None else (mesh.get_group() if mesh else None)
        if process_group is not None and mesh is not None:
            if dist.get_world_size(process_group) != W or dist.get_rank(process_group) != rank:
                raise OwnerComputeError(
                    f"process_group has size {dist.get_world_size(process_group)} and this rank is "
                    f"{dist.get_rank(process_group)} in it, but the parameters' mesh has size {W} "
                    f"and this rank is {rank} in it; pass the FSDP2 shard group (or None)"
                )
        shard0 = self._classify(rules, holdings, W, rank)
        self.plan = plan_owners([self._item(holdings[i], self._specs[i]) for i in shard0], W, engine="fsdp2")
        _plan_holdings(self.plan, [holdings[i] for i in shard0])
        self._setup(inner_optimizer_factory, groups, holdings, group, W, rank)
        if self._unit_semantics() == "matrix":  # torch's Muon on a fused weight: one matrix, not its parts
            self._refuse_parts(holdings)

    def _build(self, groups: NamedGroups) -> None:
        """(``follow``) FSDP2's pieces are DTensors laid out when this optimizer is built: it cannot
        rebuild over a model sharded since."""
        raise OwnerComputeError(
            "blockshard.integrations.fsdp2.OwnerComputeOptimizer was built before fully_shard replaced its "
            "parameters and cannot follow them: build it after fully_shard (with Accelerate's fsdp2 engine: "
            "after accelerator.prepare(model), then prepare the optimizer)"
        )

    def _classify(self, rules: SemanticsRules, holdings: list[Holding], w: int, r: int) -> list[int]:
        """Check every placement; mark FSDP2 ``Shard(0)`` parameters as planned. Returns their indices."""
        self._resolved = {}
        shard0 = []
        for i, (q, spec) in enumerate(zip(holdings, self._specs, strict=True)):
            res = rules.resolve(spec)
            self._resolved[q.name] = res
            q.parts = fused_parts(res.label)  # [Note: fused parts]: refused below for an inner Muon
            mn = math.prod(spec.shape[-2:]) if len(spec.shape) >= 3 else 0
            if mn and res.grid.unit_numel == mn:  # stacked experts: the inner optimizer gets each (m, n) matrix
                q.matrix_numel = mn
            p = q.param
            if not isinstance(p, DTensor) or w == 1:
                continue
            (pl,) = p.placements
            if isinstance(pl, Replicate):
                continue
            if type(pl) is not Shard:
                raise OwnerComputeError(
                    f"parameter {q.name!r} has placement {pl}; expected FSDP2's Shard(dim) or Replicate"
                )
            if pl.dim != 0:
                if not dim_split_keeps_units(res.grid, spec.shape, pl.dim, w):
                    raise OwnerComputeError(
                        f"parameter {q.name!r} of shape {spec.shape} is sharded by FSDP2 with {pl}, which splits "
                        f"its units under semantics {res.label!r} at W={w}; shard the model with "
                        "blockshard.integrations.fsdp2.fully_shard(..., semantics=...)"
                    )
                continue
            decide(spec, res, w, other_dims=False)  # raises FSDP2PlacementError where nothing works
            rows, row_numel = rows_cols(spec.shape)
            c = ceil_div(rows, w)
            lo, hi = min(r * c, rows), min((r + 1) * c, rows)
            local = p.to_local()
            if tuple(local.shape) != (hi - lo, *spec.shape[1:]) or not local.is_contiguous():
                raise OwnerComputeError(
                    f"parameter {q.name!r}: local shard has shape {tuple(local.shape)} (contiguous: "
                    f"{local.is_contiguous()}), but FSDP2's Shard(0) at W={w} gives rank {r} rows [{lo}, {hi}); "
                    "is it sharded by torch.distributed.fsdp.fully_shard on this mesh?"
                )
            q.local_start, q.local_numel = lo * row_numel, (hi - lo) * row_numel
            shard0.append(i)
        return shard0

    def _item(self, q: Holding, spec: TensorSpec) -> PlanItem:
        res = self._resolved[q.name]
        return PlanItem(spec, res.grid, res.cost, res.label)
