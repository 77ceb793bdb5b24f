"""One group's layout from its plan items: the bucket plan turned into a :class:`GroupLayout`
(used by the policy search, the quantized-gather plan and the model planner alike)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from blockshard._errors import PlanError
from blockshard._limits import MAX_GROUP_TENSORS, MAX_PADDED_NUMEL
from blockshard.planner._buckets import plan_buckets
from blockshard.planner._items import PlanItem
from blockshard.planner._layout import GroupLayout, TensorPlacement
from blockshard.planner._units import Memo, check_alignment_bytes, check_world_size

__all__ = ["DEFAULT_ALIGNMENT_BYTES", "alignment_numel", "plan_group"]

DEFAULT_ALIGNMENT_BYTES = 16


def alignment_numel(alignment_bytes: int, itemsize: int) -> int:
    """Elements per alignment step: the smallest count whose bytes are a multiple of ``alignment_bytes``
    (a power of two, see :func:`check_alignment_bytes`)."""
    return math.lcm(check_alignment_bytes(alignment_bytes), itemsize) // itemsize


def plan_group(
    items: Sequence[PlanItem],
    world_size: int,
    *,
    name: str = "",
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    _memo: Memo | None = None,
) -> GroupLayout:
    """Lay out one group (the tensors gathered by one collective) on ``world_size`` ranks."""
    world_size = check_world_size(world_size)
    if not items:
        raise PlanError(f"group {name!r} has no tensors; every group needs at least one parameter")
    if len(items) > MAX_GROUP_TENSORS:
        raise PlanError(
            f"group {name!r} has {len(items):,} tensors, more than the {MAX_GROUP_TENSORS:,} one group may "
            "hold (packing one group is superlinear in its tensors); split it into several groups "
            '(fully_shard per layer, or the "group" key of a shapes file)'
        )
    dtypes = {it.spec.dtype for it in items}
    if len(dtypes) > 1:
        by = {d: [it.name for it in items if it.spec.dtype == d][:3] for d in sorted(dtypes)}
        raise PlanError(
            f"group {name!r} mixes dtypes {by}: one collective moves one dtype. Fix: put tensors of "
            "different dtypes in different groups (or cast them to one dtype first)"
        )
    itemsize = items[0].spec.itemsize
    align = alignment_numel(alignment_bytes, itemsize)
    grids = tuple(it.grid for it in items)
    key = (grids, world_size, align)
    hit: tuple[tuple[int, ...], list[int], list[int], int] | None = _memo.get(key) if _memo is not None else None
    if hit is None:
        hit = plan_buckets(grids, world_size, align)
        if _memo is not None:
            _memo[key] = hit
    buckets, bucket_of, offsets, lb = hit
    if world_size * sum(buckets) > MAX_PADDED_NUMEL:
        raise PlanError(
            f"group {name!r} needs {world_size:,} ranks x {sum(buckets):,} elements per rank, more than "
            f"{MAX_PADDED_NUMEL:,} (2**60) elements in all; check the tensor shapes, or lower the world "
            "size or alignment_bytes"
        )
    order = sorted(range(len(items)), key=lambda i: (bucket_of[i], offsets[i], offsets[i] + items[i].grid.numel))
    placements = tuple(
        TensorPlacement(items[i].name, items[i].spec.shape, offsets[i], items[i].grid, items[i].label, bucket_of[i])
        for i in order
    )
    return GroupLayout(name, world_size, align, items[0].spec.dtype, itemsize, lb, buckets, placements)
