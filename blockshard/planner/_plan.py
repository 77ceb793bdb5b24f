"""Planning a whole model: one layout per group, metrics, JSON."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from blockshard._errors import PlanError
from blockshard.planner._compute import ComputeTally, OwnerAssignment, OwnerPlanBuilder
from blockshard.planner._items import PlanItem, group_items, resolve_items
from blockshard.planner._lay_out import DEFAULT_ALIGNMENT_BYTES, alignment_numel, plan_group
from blockshard.planner._layout import GroupLayout
from blockshard.planner._policy import check_policy, choose_layout
from blockshard.planner._qgather import (
    QuantizedGatherBytes,
    Tile,
    gather_buffers_name,
    plan_gather_buffers,
    quantized_gather_totals,
    tile_semantics,
)
from blockshard.planner._quantized import QuantizedGroupBytes, plan_quantized_group, quantized_totals
from blockshard.planner._tile_placement import auto_tile_placed, tile_placed
from blockshard.planner._units import Memo, check_model_tensors, check_world_size
from blockshard.semantics import TensorSpec

__all__ = ["ModelPlan", "alignment_numel", "group_kind", "plan_group", "plan_model"]


def _peak_over_mean(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 1.0


_DIGITS = re.compile(r"(?<=\.)\d+(?=[.\[]|$)|^\d+(?=[.\[]|$)")


def group_kind(group_name: str) -> str:
    """``model.layers.7`` -> ``model.layers.*`` (``model.layers.7[quantized gather]`` ->
    ``model.layers.*[quantized gather]``); the root group ``""`` -> ``(root)``."""
    return _DIGITS.sub("*", group_name) if group_name else "(root)"


@dataclass(frozen=True)
class ModelPlan:
    world_size: int
    groups: tuple[GroupLayout, ...]
    plan_seconds: float
    items: tuple[PlanItem, ...]
    cost_per_rank: tuple[float, ...] = ()  # optimizer compute per rank (e.g. Newton-Schulz FLOPs)
    cost_per_rank_unrotated: tuple[float, ...] = ()  # the same had no group been rotated
    policy: str = "whole"  # what plan_model was asked for
    owner_tensors: frozenset[str] = frozenset()  # tensors laid out under the owner policy
    owners: OwnerAssignment | None = None  # the owner of every cut compute unit
    compute_by_kind: Mapping[str, ComputeTally] = field(default_factory=dict)  # per group kind
    # what each rank computes itself (its whole compute units), before owners are chosen: no owner
    # plan gets the busiest rank below max(this), see [Note: owners across groups]
    cost_per_rank_fixed: tuple[float, ...] = ()
    # the quantized weights of every group that has some ([Note: planned quantized bytes])
    quantized_groups: tuple[QuantizedGroupBytes, ...] = ()
    # the weights gathered quantized, one per group that has some ([Note: planned quantized gather]);
    # their float layouts are in ``groups`` too
    quantized_gather_groups: tuple[QuantizedGatherBytes, ...] = ()
    # tile_placement=True: every tile-major part's name -> its weight's item ([Note: planned tile placement])
    tile_parts_of: Mapping[str, PlanItem] = field(default_factory=dict)

    def policy_of(self, name: str) -> str:
        """``"owner"`` or ``"whole"``: how tensor ``name``'s compute units are placed."""
        return "owner" if name in self.owner_tensors else "whole"

    def policy_by_tensor_kind(self) -> dict[str, dict[str, int]]:
        """Tensors whose compute units are coarser than their placement units, by tensor kind
        (``model.layers.*.mlp.up_proj.weight``): how many are under each policy."""
        out: dict[str, dict[str, int]] = {}
        for it in self.items:
            if it.coarse:
                counts = out.setdefault(group_kind(it.name), {"whole": 0, "owner": 0})
                counts[self.policy_of(it.name)] += 1
        return out

    @property
    def compute(self) -> ComputeTally:
        """The per-rank tallies of the whole model (every group kind together)."""
        tallies = list(self.compute_by_kind.values())
        W = self.world_size
        return ComputeTally(
            cost=np.asarray(self.cost_per_rank, dtype=np.float64) if self.cost_per_rank else np.zeros(W),
            state_bytes=sum((t.state_bytes for t in tallies), np.zeros(W)),
            all_to_all_bytes=sum((t.all_to_all_bytes for t in tallies), np.zeros(W)),
            largest_unit_cost=max((t.largest_unit_cost for t in tallies), default=0.0),
            modeled_cost_bytes=sum(t.modeled_cost_bytes for t in tallies),
            owner_tensors=len(self.owner_tensors),
        )

    @property
    def fixed_cost_over_lower_bound(self) -> float:
        """The busiest rank's cost from its own whole compute units alone, over ``max(mean, largest
        unit)``: the best any owner plan of these layouts can reach (the owners add to it)."""
        lb = self.compute.cost_lower_bound
        return max(self.cost_per_rank_fixed, default=0.0) / lb if lb > 0 else 1.0

    @property
    def max_cost_over_mean(self) -> float:
        return _peak_over_mean(self.cost_per_rank)

    @property
    def max_cost_over_mean_unrotated(self) -> float:
        return _peak_over_mean(self.cost_per_rank_unrotated)

    @property
    def total_numel(self) -> int:
        """The tensors' own elements (the zeros of a master's slots in packed tile order are padding)."""
        return sum(g.total_numel for g in self.groups) - sum(q.edge_padding_numel for q in self.quantized_gather_groups)

    @property
    def padded_numel(self) -> int:
        return sum(g.padded_numel for g in self.groups)

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.total_numel / self.padded_numel if self.padded_numel else 0.0

    @property
    def max_segment_over_lower_bound(self) -> float:
        return max(g.segment_over_lower_bound for g in self.groups)

    @property
    def segment_numel_per_rank(self) -> int:
        """Persistent elements each rank holds across all groups (sum of the segment sizes)."""
        return sum(g.segment_numel for g in self.groups)

    @property
    def allgather_bytes_per_rank(self) -> int:
        """Bytes each rank receives in one all-gather of every group (a quantized-gather layout's
        all-gather moves its quantized segments, ``(W - 1) * S_q``)."""
        gathered = {q.layout.name: (self.world_size - 1) * q.segment_bytes for q in self.quantized_gather_groups}
        return sum(gathered.get(g.name, g.allgather_bytes_per_rank) for g in self.groups)

    def items_by_group(self) -> dict[str, list[PlanItem]]:
        """The items of every layout in ``groups``, by its name (a group's weights gathered
        quantized under ``<group>[quantized gather]``)."""
        grouped = {g: self._originals(items) for g, items in group_items(self.items).items()}
        if not self.quantized_gather_groups:
            return grouped
        moved = {name for q in self.quantized_gather_groups for name in q.tensors}
        moved |= {self.tile_parts_of[n].name for n in moved if n in self.tile_parts_of}
        out: dict[str, list[PlanItem]] = {}
        for name, items in grouped.items():
            if rest := [it for it in items if it.name not in moved]:
                out[name] = rest
            if gathered := [it for it in items if it.name in moved]:
                out[gather_buffers_name(name)] = gathered
        return out

    def _originals(self, items: list[PlanItem]) -> list[PlanItem]:
        """``items`` with tile-major parts replaced by their weights (once each, in order)."""
        if not self.tile_parts_of:
            return items
        out: dict[str, PlanItem] = {}
        for it in items:
            orig = self.tile_parts_of.get(it.name, it)
            out.setdefault(orig.name, orig)
        return list(out.values())

    def quantized_by_kind(self) -> dict[str, dict[str, int | float]]:
        """Quantized bytes per group kind (``model.layers.*``), as :meth:`quantized_totals`."""
        kinds: dict[str, list[QuantizedGroupBytes]] = {}
        for q in self.quantized_groups:
            kinds.setdefault(group_kind(q.group), []).append(q)
        return {k: {"num_groups": len(qs), **quantized_totals(qs, self.world_size)} for k, qs in kinds.items()}

    def quantized_totals(self) -> dict[str, int | float]:
        """Payload and scales of the quantized weights: per rank (max, mean), gathered per step, bf16's."""
        return quantized_totals(self.quantized_groups, self.world_size)

    def quantized_gather_by_kind(self) -> dict[str, dict[str, int | float]]:
        """The weights gathered quantized per group kind, as :meth:`quantized_gather_totals`."""
        kinds: dict[str, list[QuantizedGatherBytes]] = {}
        for q in self.quantized_gather_groups:
            kinds.setdefault(group_kind(q.group), []).append(q)
        W = self.world_size
        return {k: {"num_groups": len(qs), **quantized_gather_totals(qs, W)} for k, qs in kinds.items()}

    def quantized_gather_totals(self) -> dict[str, int | float]:
        """The weights gathered quantized: masters and quantized segments per rank, gathered per step."""
        return quantized_gather_totals(self.quantized_gather_groups, self.world_size)

    def group(self, name: str) -> GroupLayout:
        for g in self.groups:
            if g.name == name:
                return g
        raise PlanError(f"no group named {name!r}; groups: {[g.name for g in self.groups][:20]}")

    def rank_loads(self) -> list[int]:
        """Real (non-padding) elements per rank summed over groups (for plots of per-rank load)."""
        loads = [0] * self.world_size
        seen: dict[tuple[object, ...], list[int]] = {}
        for g in self.groups:  # identical blocks share one computation
            key = (g.buckets, tuple((t.bucket, t.offset, t.numel) for t in g.tensors))
            per = seen.get(key)
            if per is None:
                per = seen[key] = g.rank_loads()
            for r, x in enumerate(per):
                loads[r] += x
        return loads

    def by_kind(self) -> dict[str, list[GroupLayout]]:
        out: dict[str, list[GroupLayout]] = {}
        for g in self.groups:
            out.setdefault(group_kind(g.name), []).append(g)
        return out

    def to_json(self, *, layouts: bool = False) -> dict[str, object]:
        data: dict[str, object] = {
            "world_size": self.world_size,
            "num_groups": len(self.groups),
            "num_tensors": sum(len(g.tensors) for g in self.groups),
            "total_numel": self.total_numel,
            "padded_numel": self.padded_numel,
            "padding_fraction": self.padding_fraction,
            "max_segment_over_lower_bound": self.max_segment_over_lower_bound,
            "segment_numel_per_rank": self.segment_numel_per_rank,
            "num_collectives": sum(len(g.buckets) for g in self.groups),
            "allgather_bytes_per_rank": self.allgather_bytes_per_rank,
            "plan_seconds": self.plan_seconds,
            # [Note: planned tile placement]: the weights planned in tile-major parts
            "tile_placed_weights": len({it.name for it in self.tile_parts_of.values()}),
            "max_cost_over_mean": self.max_cost_over_mean,
            "max_cost_over_mean_unrotated": self.max_cost_over_mean_unrotated,
            "optimizer_cost_fixed_max_over_lower_bound": self.fixed_cost_over_lower_bound,
            "policy": self.policy,
            **self.compute.to_json(),
            "policy_by_tensor_kind": self.policy_by_tensor_kind(),
            "owner_units": self.owners.num_units if self.owners else 0,
            "owner_hash": self.owners.owner_hash() if self.owners else None,
        }
        if self.quantized_groups:
            data["quantized"] = {
                **self.quantized_totals(),
                "groups_by_kind": [{"kind": k, **v} for k, v in self.quantized_by_kind().items()],
            }
        if self.quantized_gather_groups:
            data["quantized_gather"] = {
                **self.quantized_gather_totals(),
                "groups_by_kind": [{"kind": k, **v} for k, v in self.quantized_gather_by_kind().items()],
            }
        if layouts:
            data["layout_hashes"] = {g.name: g.layout_hash() for g in self.groups}
            data["layouts"] = [g.to_json() for g in self.groups]
            data |= self.quantized_groups_json()
        return data

    def quantized_groups_json(self) -> dict[str, list[dict[str, Any]]]:
        """Every group's quantized bytes (``quantized_groups``, ``quantized_gather_groups``), where any."""
        data: dict[str, list[dict[str, Any]]] = {}
        if self.quantized_groups:
            data["quantized_groups"] = [q.to_json() for q in self.quantized_groups]
        if self.quantized_gather_groups:
            data["quantized_gather_groups"] = [q.to_json() for q in self.quantized_gather_groups]
        return data


def plan_model(
    tensors: Iterable[TensorSpec | PlanItem],
    world_size: int,
    *,
    semantics: object = None,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    progress: Callable[[int, int], None] | None = None,
    policy: str = "auto",
    quantized_gather: bool = False,
    tile_placement: bool | str = False,
) -> ModelPlan:
    """Plan every group of a model. Tensors are grouped by ``TensorSpec.group`` (``None`` -> root).

    ``semantics`` is anything :meth:`SemanticsRules.coerce` accepts (ignored for ``PlanItem``
    inputs, which already carry their grids). Groups with the same grids in the same order share
    one search (transformer blocks are identical), so time grows with the number of distinct
    groups plus a linear pass over tensors.

    ``policy`` places the compute units of tensors that have coarser compute than placement
    units (see ``planner/_policy.py``): ``"whole"`` (one rank each: what ``fully_shard`` builds
    today), ``"owner"`` (storage cut at placement units, each cut compute unit computed at an
    owner) or ``"auto"`` (per tensor, by a cost in bytes; the default).

    ``quantized_gather=True`` plans as ``fully_shard(..., quantized_gather=True)``: the float
    tensors whose semantics is ``mx``, ``mx:4`` or ``fp8_block:B`` get a layout of their own per
    group (``<group>[quantized gather]``, in ``groups``) and their quantized segments are in
    ``quantized_gather_groups`` ([Note: planned quantized gather] in ``planner/_qgather.py``).

    ``tile_placement=True`` plans every weight whose only semantics is ``fp8_block:B`` in its
    tile-major parts, one tile as the placement unit ([Note: planned tile placement] in
    ``planner/_tile_placement.py``): what ``fully_shard(..., tile_placement=True)`` builds for frozen
    FP8 weights; with ``quantized_gather=True`` the trainable masters in packed tile order
    (``packed_masters``, as ``fully_shard(..., quantized_gather=True, tile_placement=True)``; the
    zeros of their slots count as padding). ``tile_placement="auto"``: as ``fully_shard(...,
    tile_placement="auto")``, per group the frozen FP8 weights by tiles where that pads less (the
    masters by stripes).
    """
    world_size = check_world_size(world_size)
    policy = check_policy(policy)
    if not isinstance(quantized_gather, bool):
        raise PlanError(
            f"quantized_gather={quantized_gather!r} must be True or False (True: plan the weights with 'mx', "
            "'mx:4' or 'fp8_block:B' semantics as fully_shard(..., quantized_gather=True) gathers them)"
        )
    t0 = time.perf_counter()
    raw = list(tensors)
    if not raw:
        raise PlanError("the model has no tensors to plan; pass at least one TensorSpec (is the shapes file empty?)")
    check_model_tensors(len(raw), "the model")
    specs = [t for t in raw if isinstance(t, TensorSpec)]
    items = list(resolve_items(specs, semantics)) if specs else []
    if len(specs) != len(raw):
        if specs:
            raise PlanError("tensors mixes TensorSpec and PlanItem entries; pass one kind")
        items = [t for t in raw if isinstance(t, PlanItem)]
    seen: set[str] = set()
    for it in items:
        if it.name in seen:
            raise PlanError(f"tensor name {it.name!r} appears twice; every parameter needs a unique name")
        seen.add(it.name)
    if not (isinstance(tile_placement, bool) or tile_placement == "auto"):
        raise PlanError(
            f"tile_placement={tile_placement!r} must be True, False or 'auto' (True: plan fp8_block weights with one "
            "tile as the placement unit, docs/design.md's 'Tile placement'; 'auto': frozen ones per group, whichever "
            "pads less, as fully_shard builds)"
        )
    tiles = tile_semantics(raw, semantics) if quantized_gather else {}
    parts_of: dict[str, PlanItem] = {}
    if tile_placement and not specs:
        raise PlanError(
            f"tile_placement={tile_placement!r} needs the tensors as TensorSpec (it reads their semantics), not PlanItem"
        )
    if tile_placement == "auto":
        items, parts_of = auto_tile_placed(items, semantics, tiles, world_size, alignment_bytes)
    elif tile_placement:
        items, parts_of = tile_placed(items, semantics, tiles)
    plan = _plan_groups(items, world_size, policy, alignment_bytes, tiles, progress, t0, semantics, tile_placement)
    return dataclasses.replace(plan, tile_parts_of=parts_of) if parts_of else plan


def _plan_groups(
    items: list[PlanItem],
    world_size: int,
    policy: str,
    alignment_bytes: int,
    tiles: dict[str, Tile],
    progress: Callable[[int, int], None] | None,
    t0: float,
    semantics: object = None,
    tile_placement: bool | str = False,
) -> ModelPlan:
    """Lay out every group of ``items`` (the tensors in ``tiles`` gathered quantized) and balance them."""
    grouped = group_items(items)
    memo: Memo = {}
    layouts = []
    costs = {it.name: it.cost for it in items}
    running = np.zeros(world_size)  # compute cost per rank so far (see [Note: rotation])
    unrotated = np.zeros(world_size)  # the same without rotation, for the report
    builder = OwnerPlanBuilder(world_size, memo)
    owner_tensors: set[str] = set()
    quantized: list[QuantizedGroupBytes] = []
    gathered: list[QuantizedGatherBytes] = []
    for i, (gname, all_items) in enumerate(grouped.items()):
        gathers = 1 if gname == "" else 2  # the root is not resharded after forward (FSDP2's default)
        gitems = [it for it in all_items if it.name not in tiles]
        if gitems:
            layout, owned, modeled = choose_layout(
                gitems, world_size, policy, name=gname, alignment_bytes=alignment_bytes, memo=memo
            )
            owner_tensors |= owned
            compute = {it.name: it.grid for it in gitems if it.name in owned}
            layouts.append(builder.add_group(layout, group_kind(gname), compute, costs, running, modeled, unrotated))
        stored = [(it.name, it.storage) for it in gitems if it.storage is not None]
        if stored:
            quantized.append(
                plan_quantized_group(gname, stored, world_size, alignment_bytes, gathers_per_step=gathers, memo=memo)
            )
        if qitems := [it for it in all_items if it.name in tiles]:  # [Note: planned quantized gather]
            q = plan_gather_buffers(
                gname, qitems, tiles, world_size, policy, alignment_bytes, gathers, memo,
                semantics=semantics, tile_placement=tile_placement,
            )  # fmt: skip
            layouts.append(q.layout)
            gathered.append(q)
        if progress is not None:
            progress(i + 1, len(grouped))
    fixed = tuple(running.tolist())  # before the owners of cut units add theirs
    owners, by_kind = builder.finish(running)  # see [Note: owners across groups]
    return ModelPlan(
        world_size,
        tuple(layouts),
        time.perf_counter() - t0,
        tuple(items),
        tuple(running.tolist()),
        tuple(unrotated.tolist()),
        policy,
        frozenset(owner_tensors),
        owners,
        by_kind,
        fixed,
        tuple(quantized),
        tuple(gathered),
    )
