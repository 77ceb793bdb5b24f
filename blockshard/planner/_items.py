"""``PlanItem``: one tensor as the planner sees it (its spec plus resolved unit grids and cost)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from blockshard.semantics import ResolvedSemantics, SemanticsRules, TensorSpec, UnitGrid
from blockshard.semantics._storage import QuantizedStorage

__all__ = ["PlanItem", "resolve_items"]


@dataclass(frozen=True)
class PlanItem:
    """``grid``: the compute units (what ``whole`` placement keeps on one rank); ``placement_grid``:
    the placement units (where ``owner`` placement cuts the storage), ``None`` when they are the same;
    ``storage``: the quantizer's byte sections (``None``: the tensor is stored in its dtype)."""

    spec: TensorSpec
    grid: UnitGrid
    cost: float
    label: str = "elementwise"
    placement_grid: UnitGrid | None = None
    storage: QuantizedStorage | None = None

    @property
    def placement(self) -> UnitGrid:
        return self.grid if self.placement_grid is None else self.placement_grid

    @property
    def coarse(self) -> bool:
        """Whether its compute units are coarser than its placement units (a policy can choose)."""
        return self.placement != self.grid

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def numel(self) -> int:
        return self.spec.numel


def resolve_items(specs: Iterable[TensorSpec], rules: object = None) -> list[PlanItem]:
    """Give every spec its semantics (``rules`` as :meth:`SemanticsRules.coerce` accepts)."""
    r = SemanticsRules.coerce(rules)
    cache: dict[tuple[object, ...], ResolvedSemantics] = {}
    out: list[PlanItem] = []
    for spec in specs:
        sems = r.matching(spec)
        # Rules depend on the name, so resolve per tensor; grids depend only on (semantics, shape).
        key = (tuple(s.spec for s in sems), spec.shape, spec.dtype)
        res = cache.get(key)
        if res is None:
            res = r.resolve(spec, sems)
            cache[key] = res
        out.append(PlanItem(spec, res.grid, res.cost, res.label, res.placement_grid, res.storage))
    return out


def group_items(items: Sequence[PlanItem]) -> dict[str, list[PlanItem]]:
    """Items by group name (a ``None`` group is the root group ``""``): groups in first-seen
    order, the root last — the order of bottom-up ``fully_shard`` calls (layers, then the root)."""
    groups: dict[str, list[PlanItem]] = {}
    for it in items:
        groups.setdefault(it.spec.group or "", []).append(it)
    if "" in groups:
        groups[""] = groups.pop("")
    return groups
