"""Comparing a plan with what today's engines do, per group kind and in total."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from blockshard.planner._baselines import BASELINES, BaselineResult, baseline, combine
from blockshard.planner._compute import ComputeTally
from blockshard.planner._items import PlanItem
from blockshard.planner._plan import ModelPlan

__all__ = ["Comparison", "KindRow", "compare"]


@dataclass(frozen=True)
class KindRow:
    """One kind of group (``model.layers.*``): blockshard's layout beside each baseline."""

    kind: str
    num_groups: int
    num_tensors: int  # per group, the largest
    num_collectives: int  # per group (buckets), the largest
    segment_numel: int  # S, the largest in the kind
    lower_bound: int
    segment_over_lower_bound: float
    padding_fraction: float
    baselines: dict[str, BaselineResult]
    compute: ComputeTally | None = None  # per-rank optimizer facts of the kind's groups

    def to_json(self) -> dict[str, Any]:
        return {
            **(self.compute.to_json() if self.compute is not None else {}),
            "kind": self.kind,
            "num_groups": self.num_groups,
            "num_tensors": self.num_tensors,
            "num_collectives": self.num_collectives,
            "segment_numel": self.segment_numel,
            "lower_bound": self.lower_bound,
            "segment_over_lower_bound": self.segment_over_lower_bound,
            "padding_fraction": self.padding_fraction,
            "baselines": {k: _baseline_json(v) for k, v in self.baselines.items()},
        }


def _baseline_json(b: BaselineResult) -> dict[str, Any]:
    return {
        "padding_fraction": b.padding_fraction,
        "splits_units": b.splits_units,
        "per_rank_numel": b.per_rank_numel,
        "block_respecting": b.block_respecting,
    }


@dataclass(frozen=True)
class Comparison:
    plan: ModelPlan
    kinds: tuple[KindRow, ...]
    baselines: dict[str, BaselineResult]  # whole model

    def to_json(self) -> dict[str, Any]:
        data = self.plan.to_json()
        data["baselines"] = {k: _baseline_json(v) for k, v in self.baselines.items()}
        data["groups_by_kind"] = [k.to_json() for k in self.kinds]
        return data


def compare(plan: ModelPlan, baselines: Sequence[str] = BASELINES) -> Comparison:
    """Compute every baseline for every group of ``plan`` (identical groups computed once)."""
    W = plan.world_size
    items_by_group = plan.items_by_group()
    memo: dict[tuple[object, ...], BaselineResult] = {}

    def base(name: str, items: list[PlanItem]) -> BaselineResult:
        key = (name, tuple((it.spec.shape, it.grid) for it in items))
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = baseline(name, items, W)
        return hit

    per_group = {g.name: {b: base(b, items_by_group[g.name]) for b in baselines} for g in plan.groups}
    rows = []
    for kind, layouts in plan.by_kind().items():
        total = sum(g.total_numel for g in layouts)
        padded = sum(g.padded_numel for g in layouts)
        rows.append(
            KindRow(
                kind=kind,
                num_groups=len(layouts),
                num_tensors=max(len(g.tensors) for g in layouts),
                num_collectives=max(len(g.buckets) for g in layouts),
                segment_numel=max(g.segment_numel for g in layouts),
                lower_bound=max(g.lower_bound for g in layouts),
                segment_over_lower_bound=max(g.segment_over_lower_bound for g in layouts),
                padding_fraction=1.0 - total / padded if padded else 0.0,
                baselines={b: combine([per_group[g.name][b] for g in layouts]) for b in baselines},
                compute=plan.compute_by_kind.get(kind),
            )
        )
    totals = {b: combine([per_group[g.name][b] for g in plan.groups]) for b in baselines}
    return Comparison(plan, tuple(rows), totals)
