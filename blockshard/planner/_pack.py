"""The layout search: equal segments, holes only between tensors, cuts only on unit boundaries.

[Note: how the packer works]
For a candidate segment size ``S`` the packer walks a cursor ``p`` through the gathered buffer.
At each step it places, among the tensors not yet placed, the one that can start closest to
``p`` (the smallest hole): first the largest whole tensor that still fits before the next rank
boundary, else the tensor with the smallest hole (largest unit first, then original order). A
tensor that fits before the next rank boundary starts at ``p``. One that crosses it starts at
the first offset from which every crossed boundary lands on an allowed cut of its grid (a hole
shorter than one unit), or at the boundary itself. A tensor that crosses two or more boundaries
covers a whole segment, which requires ``S % unit == 0``: :func:`_snap` raises ``S`` to such a
multiple for every tensor of at least ``2 * S`` elements, since no order can avoid that.
Whole-tensor units (Muon matrices) never straddle a boundary, so the same walk becomes first-fit
decreasing bin packing, with fine-unit tensors filling the gaps.
``S`` starts at the lower bound ``max(ceil(total / W), largest unit)``; when a walk overflows
``W * S`` the search tries the next multiple of every straddling tensor's unit, else grows ``S``
geometrically, and then bisects back to the smallest ``S`` that packs. Tensors with equal grids form
one *grid class* (interchangeable for the walk), so one step costs O(number of grid classes).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence

from blockshard.planner._units import ceil_div, check_alignment_numel, check_world_size, round_up
from blockshard.semantics import UnitGrid

__all__ = ["lower_bound", "pack"]


def lower_bound(grids: Sequence[UnitGrid], world_size: int, alignment_numel: int) -> int:
    total = sum(g.numel for g in grids)
    largest = max((g.largest_unit for g in grids), default=0)
    return round_up(max(ceil_div(total, world_size), largest, 1), alignment_numel)


def _allows(grid: UnitGrid, x: int) -> bool:
    return grid.min_cut <= x <= grid.max_cut and x % grid.unit_numel == 0


def _fits_at(o: int, grid: UnitGrid, S: int) -> bool:
    """Whether every rank boundary strictly inside ``[o, o + numel)`` is an allowed cut."""
    end = o + grid.numel
    first = (o // S + 1) * S
    if first >= end:
        return True
    if not _allows(grid, first - o):
        return False
    last = ((end - 1) // S) * S
    if last == first:
        return True
    # boundaries first, first + S, ..., last: all multiples of the unit iff S is
    return S % grid.unit_numel == 0 and _allows(grid, last - o)


def _first_offset(p: int, grid: UnitGrid, S: int) -> int | None:
    """The smallest offset ``>= p`` where the tensor can start, or None if no offset works."""
    n = grid.numel
    nb = (p // S + 1) * S  # next boundary after p
    if p + n <= nb:
        return p
    if grid.is_whole:
        return nb if n <= S else None
    u = grid.unit_numel
    o1 = p + (nb - p) % u  # the first crossing lands on a multiple of the unit
    candidates = [o1]
    last = ((o1 + n - 1) // S) * S
    if last - o1 > grid.max_cut:  # the tail would be shorter than the last unit: start later
        candidates.append(o1 + round_up(last - o1 - grid.max_cut, u))
    candidates.append(nb)
    for o in candidates:
        if o <= nb and _fits_at(o, grid, S):
            return o
    return None


# Grid classes scanned per step: bounds the walk to O(tensors) when a group has thousands of distinct
# grids (real models have a handful per group, so the cap never binds there).
_MAX_SCAN = 64


def _walk(grids: Sequence[UnitGrid], classes: list[list[int]], S: int, limit: int) -> list[int] | None:
    """Place every tensor for segment size ``S``; returns the offsets, or None if ``W * S`` overflows.

    Whole tensors are kept sorted by size, so "the largest that fits before the boundary" is a
    bisection; the other grid classes are scanned in order (at most ``_MAX_SCAN`` of them), stopping
    at the first zero hole.
    """
    whole: dict[int, deque[int]] = {}
    fine: list[deque[int]] = []
    for cls in classes:
        g = grids[cls[0]]
        if g.is_whole:
            whole.setdefault(g.numel, deque()).extend(cls)
        else:
            fine.append(deque(cls))
    sizes = sorted(whole)
    offsets = [0] * len(grids)
    p = 0

    def take_whole(k: int, at: int) -> int:
        n = sizes[k]
        i = whole[n].popleft()
        if not whole[n]:
            del whole[n], sizes[k]
        offsets[i] = at
        return at + n

    remaining = len(grids)
    while remaining:
        remaining -= 1
        nb = (p // S + 1) * S
        k = bisect.bisect_right(sizes, nb - p) - 1
        if k >= 0:  # the largest whole tensor that fits before the boundary: no hole
            p = take_whole(k, p)
        else:
            best_c, best_o = -1, -1
            for ci in range(min(len(fine), _MAX_SCAN)):
                o = _first_offset(p, grids[fine[ci][0]], S)
                if o is not None and (best_c < 0 or o < best_o):
                    best_c, best_o = ci, o
                    if o == p:
                        break
            if sizes and (best_c < 0 or nb < best_o):  # open the next segment with the largest whole tensor
                p = take_whole(len(sizes) - 1, nb)
            elif best_c >= 0:
                i = fine[best_c].popleft()
                offsets[i] = best_o
                p = best_o + grids[i].numel
                if not fine[best_c]:
                    del fine[best_c]
            else:
                return None  # nothing can be placed: a larger S is needed
        if p > limit:
            return None
    return offsets


def _snap(x: int, grids: Sequence[UnitGrid], alignment_numel: int) -> int:
    """The smallest admissible segment size ``>= x``.

    ``S`` is admissible when it is a multiple of ``alignment_numel`` and of the unit of every tensor
    with ``numel >= 2 S`` (such a tensor covers a whole segment wherever it starts). The set of
    such tensors shrinks as ``S`` passes ``numel // 2 + 1``, so the search steps through those
    thresholds instead of only rounding ``x`` up.
    """
    while True:
        m, next_threshold = alignment_numel, None
        for g in grids:
            if not g.is_whole and g.numel >= 2 * x:
                m = math.lcm(m, g.unit_numel)
                t = g.numel // 2 + 1
                next_threshold = t if next_threshold is None else min(next_threshold, t)
        c = round_up(x, m)
        if next_threshold is None or next_threshold >= c:
            return c
        x = next_threshold


def _grid_classes(grids: Sequence[UnitGrid]) -> list[list[int]]:
    """Indices of the tensors with equal grids (one *grid class* each), largest unit first, then
    largest tensor, then first appearance; within a class, in the given order."""
    classes: dict[UnitGrid, list[int]] = {}
    for i, g in enumerate(grids):
        classes.setdefault(g, []).append(i)
    return sorted(classes.values(), key=lambda ix: (-grids[ix[0]].largest_unit, -grids[ix[0]].numel, ix[0]))


def pack(grids: Sequence[UnitGrid], world_size: int, alignment_numel: int) -> tuple[int, list[int], int]:
    """Find ``(S, offsets, lower_bound)`` for tensors with these grids (see [Note: how the packer works])."""
    world_size = check_world_size(world_size)
    alignment_numel = check_alignment_numel(alignment_numel)
    lb = lower_bound(grids, world_size, alignment_numel)
    classes = _grid_classes(grids)

    def attempt(S: int) -> list[int] | None:
        return _walk(grids, classes, S, world_size * S)

    S = _snap(lb, grids, alignment_numel)
    offsets = attempt(S)
    if offsets is not None:
        return S, offsets, lb
    fail = S
    # A segment that every straddling tensor's unit divides lets each of them cross any number of
    # boundaries; it is often the first size that packs (e.g. 16384-element NF4 super-blocks).
    m = alignment_numel
    for g in grids:
        if not g.is_whole and g.numel > S:
            m = math.lcm(m, g.unit_numel)
    tiled = round_up(S, m)
    ok = None
    if tiled <= 2 * S:
        offsets = attempt(tiled)
        if offsets is not None:
            ok, ok_offsets = tiled, offsets
    if ok is None:  # grow geometrically until a walk fits
        step = max(alignment_numel, S // 1024)
        while True:
            S = _snap(fail + step, grids, alignment_numel)
            offsets = attempt(S)
            if offsets is not None:
                break
            fail, step = S, step * 2
        ok, ok_offsets = S, offsets
    while True:  # bisect between the last failure and the smallest success
        mid = _snap((fail + ok) // 2, grids, alignment_numel)
        if mid >= ok or mid <= fail:
            break
        offsets = attempt(mid)
        if offsets is not None:
            ok, ok_offsets = mid, offsets
        else:
            fail = mid
    return ok, ok_offsets, lb
