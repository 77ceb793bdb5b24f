"""Placement policies: per tensor, keep compute units whole on one rank, or compute them at an owner.

[Note: policy cost model]
A tensor whose compute units are coarser than its placement units (``PlanItem.coarse``: Muon
matrices, Shampoo stripes, experts) can be laid out two ways:

``whole``  on its compute grid: every compute unit on one rank, no optimizer communication, but
           ``S >= largest unit``, so coarse units pad when they are large against ``total / W``;
``owner``  on its placement grid (storage cut anywhere a placement unit allows); every compute
           unit that a rank boundary cuts goes to an owner rank at the optimizer step.

``auto`` chooses by a cost in bytes per rank per optimizer step, for a group laid out with some
set of tensors under ``owner``:

* padding ``P = W * S - total`` elements costs memory on every rank (``P / W`` each) and is
  moved by the all-gather and the reduce-scatter of every step (each rank receives the other
  ranks' segments: ``(W - 1) / W * P`` per collective): ``P * (2 W - 1) / W`` elements;
* owner-compute moves the gradient pieces of every cut compute unit to its owner and the new
  values back with ``all_to_all_single``: at most ``2 * M / W`` elements per rank, ``M`` being the
  cut units' elements (the whole unit: the owner's own piece does not move, but which rank owns
  it is decided later, across all groups, so the model counts it).

Both are multiplied by the group's itemsize. The candidates of a group are: every coarse tensor
``whole``; then, for each distinct largest-unit size from the largest down, ``owner`` for the
coarse tensors with units at least that large; the last candidate is every coarse tensor under
``owner``. ``auto`` takes the cheapest, the first on ties (so ties go to ``whole``). The cost of a
group does not depend on the others, so ``auto``'s total never exceeds ``whole``'s or ``owner``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from blockshard._errors import PlanError
from blockshard.planner._compute import straddling_units
from blockshard.planner._items import PlanItem
from blockshard.planner._lay_out import plan_group
from blockshard.planner._layout import GroupLayout
from blockshard.planner._units import Memo

__all__ = ["POLICIES", "check_policy", "choose_layout", "modeled_cost_bytes"]

POLICIES: tuple[str, ...] = ("auto", "whole", "owner")


def check_policy(policy: object, name: str = "policy") -> str:
    if not isinstance(policy, str) or policy not in POLICIES:
        raise PlanError(
            f"{name}={policy!r} is not a placement policy; pass one of {', '.join(POLICIES)} "
            "(auto: chosen per tensor by cost; whole: compute units on one rank; owner: computed at an owner)"
        )
    return policy


def modeled_cost_bytes(layout: GroupLayout, owner_items: Sequence[PlanItem], memo: Memo | None = None) -> float:
    """The modeled bytes per rank per step of ``layout`` with ``owner_items`` under ``owner``."""
    W = layout.world_size
    compute = {it.name: it.grid for it in owner_items}
    moved = 0
    for t in layout.tensors:
        grid = compute.get(t.name)
        if grid is not None:
            starts, ends = straddling_units(grid, t.offset, layout.buckets[t.bucket], memo)
            moved += int((ends - starts).sum())
    pad = layout.padded_numel - layout.total_numel
    return layout.itemsize * (pad * (2 * W - 1) + 2 * moved) / W


def _candidates(items: Sequence[PlanItem], policy: str) -> list[tuple[int, ...]]:
    """Index sets of tensors laid out under ``owner``, in order of preference (``whole`` first)."""
    coarse = [i for i, it in enumerate(items) if it.coarse]
    if policy == "whole" or not coarse:
        return [()]
    if policy == "owner":
        return [tuple(coarse)]
    sizes = sorted({items[i].grid.largest_unit for i in coarse}, reverse=True)
    return [(), *(tuple(i for i in coarse if items[i].grid.largest_unit >= v) for v in sizes)]


def choose_layout(
    items: Sequence[PlanItem],
    world_size: int,
    policy: str,
    *,
    name: str,
    alignment_bytes: int,
    memo: Memo,
) -> tuple[GroupLayout, frozenset[str], float]:
    """``(layout, names of the tensors under owner, modeled cost in bytes)`` of one group under ``policy``.

    ``memo`` is shared by the groups of one model: identical groups choose once.
    """
    key = ("policy", policy, world_size, alignment_bytes, tuple((it.grid, it.placement) for it in items))
    chosen: tuple[float, tuple[int, ...]] | None = memo.get(key)
    if chosen is not None:  # an identical group chose already
        cost, owners = chosen
        layout = plan_group(
            _laid_out(items, owners), world_size, name=name, alignment_bytes=alignment_bytes, _memo=memo
        )
        return layout, frozenset(items[i].name for i in owners), cost
    best: tuple[float, tuple[int, ...], GroupLayout] | None = None
    for owners in _candidates(items, policy):
        layout = plan_group(
            _laid_out(items, owners), world_size, name=name, alignment_bytes=alignment_bytes, _memo=memo
        )
        cost = modeled_cost_bytes(layout, [items[i] for i in owners], memo)
        if best is None or cost < best[0]:
            best = (cost, owners, layout)
    assert best is not None
    cost, owners, layout = best
    memo[key] = (cost, owners)
    return layout, frozenset(items[i].name for i in owners), cost


def _laid_out(items: Sequence[PlanItem], owners: tuple[int, ...]) -> list[PlanItem]:
    """The items as the packer sees them: owner-computed tensors on their placement grids."""
    if not owners:
        return list(items)
    chosen = set(owners)
    return [dataclasses.replace(it, grid=it.placement) if i in chosen else it for i, it in enumerate(items)]
