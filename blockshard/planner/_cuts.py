"""Where rank boundaries cut a tensor's compute units, and what the cut units cost per rank.

A tensor of a one-segment-size bucket that starts at ``offset`` is cut by the rank boundaries
``k * S`` inside it; a boundary that is not an allowed cut of its grid lies inside a unit, which is
then *cut* (an owner computes it, see [Note: owners across groups] in ``_compute.py``). Everything
here depends on ``offset`` only through ``offset % S``: rotations and shifts by whole segments
repeat the same answers, which the planning memo keeps.
"""

from __future__ import annotations

import numpy as np

from blockshard.planner._units import Memo, rank_overlap
from blockshard.semantics import UnitGrid

__all__ = ["cut_cost_per_rank", "every_unit_cut", "straddling_units", "uncut", "uncut_at"]

_EMPTY = np.zeros(0, dtype=np.int64)


def uncut(grid: UnitGrid, offset: int, S: int) -> bool:
    """Whether no rank boundary cuts a unit of ``grid`` when the tensor starts at ``offset`` of a
    bucket with segment ``S``, i.e. whether :func:`straddling_units` finds none: every boundary
    inside the tensor, ``c = k * S - offset``, lies in ``[min_cut, max_cut]`` at a multiple of the
    unit (the boundaries step by ``S``: the first and last in range, the first and the step multiples)."""
    n = grid.numel
    first, last = offset // S + 1, (offset + n - 1) // S
    if n == 0 or first > last:
        return True
    if grid.is_whole:
        return False
    u, c0, c1 = grid.unit_numel, first * S - offset, last * S - offset
    return grid.min_cut <= c0 and c1 <= grid.max_cut and c0 % u == 0 and (first == last or S % u == 0)


def uncut_at(grid: UnitGrid, offsets: np.ndarray, S: int) -> np.ndarray:
    """:func:`uncut` of ``grid`` at each of ``offsets`` (the same closed form, on an array)."""
    n = grid.numel
    first, last = offsets // S + 1, (offsets + n - 1) // S
    out = (first > last) | (n == 0)
    if grid.is_whole or n == 0:
        return out
    u, c0, c1 = grid.unit_numel, first * S - offsets, last * S - offsets
    on_cuts = (grid.min_cut <= c0) & (c1 <= grid.max_cut) & (c0 % u == 0) & ((first == last) | (S % u == 0))
    return np.asarray(out | on_cuts, dtype=bool)


def every_unit_cut(grid: UnitGrid, S: int) -> bool:
    """Whether rank boundaries ``S`` apart cut every unit of ``grid`` wherever a tensor that spans two
    ranks or more starts: a unit longer than ``S`` has ``S`` offsets strictly inside it, one of them a
    boundary (and a whole grid's one unit holds every boundary inside the tensor). Then the cut units
    are the whole tensor, and :func:`cut_cost_per_rank` is its cost on each rank."""
    if grid.is_whole:
        return True
    middle = grid.unit_numel if grid.max_cut > grid.min_cut else grid.numel  # no middle unit: not the least
    return min(grid.min_cut, middle, grid.numel - grid.max_cut) > S


def straddling_units(grid: UnitGrid, offset: int, S: int, memo: Memo | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, ends)``, in the tensor's flattening, of the units of ``grid`` that a rank boundary
    cuts when the tensor starts at ``offset`` of a bucket with segment ``S`` (rank ``r`` holds
    ``[r * S, (r + 1) * S)``). Rotations move ``offset`` by multiples of ``S``: same answer."""
    key = ("straddle", grid, offset % S, S)
    hit: tuple[np.ndarray, np.ndarray] | None = memo.get(key) if memo is not None else None
    if hit is not None:
        return hit
    n = grid.numel
    first, last = offset // S + 1, (offset + n - 1) // S
    if n == 0 or first > last:
        out = (_EMPTY, _EMPTY)
    elif grid.is_whole:
        out = (np.zeros(1, dtype=np.int64), np.full(1, n, dtype=np.int64))
    elif every_unit_cut(grid, S):  # every unit, listed from the grid (fewer than the boundaries)
        cuts = np.arange(grid.min_cut, grid.max_cut + 1, grid.unit_numel, dtype=np.int64)
        out = (np.concatenate(([0], cuts)), np.concatenate((cuts, [n])))
    else:
        u, lo, hi = grid.unit_numel, grid.min_cut, grid.max_cut
        c = np.arange(first, last + 1, dtype=np.int64) * S - offset
        c = c[~((c >= lo) & (c <= hi) & (c % u == 0))]
        start = np.where(c < lo, 0, np.where(c > hi, hi, lo + ((c - lo) // u) * u))
        end = np.where(c < lo, lo, np.where(c > hi, n, start + u))
        first_of = np.flatnonzero(np.diff(start, prepend=-1))  # start rises with c: its first of each value
        out = (start[first_of], end[first_of])
    if memo is not None:
        memo[key] = out
    return out


def cut_cost_per_rank(grid: UnitGrid, offset: int, S: int, density: float, memo: Memo) -> np.ndarray | None:
    """Cost of the cut units of ``grid`` (``density`` per element) on each rank the tensor touches,
    from its first (``None`` when no unit is cut). It depends on the tensor's place in its first
    segment only: the candidates of a group (shifts, moves) repeat few places (814 of 10,987 on
    DeepSeek-V3), which ``memo`` keeps."""
    if uncut(grid, offset, S):  # straddling_units finds none
        return None
    lo, hi = offset // S, (offset + grid.numel - 1) // S  # the ranks the tensor touches
    key = ("cut cost per rank", grid, offset - lo * S, S, density)
    cut: np.ndarray | None = memo.get(key)
    if cut is None:
        starts, ends = straddling_units(grid, offset, S, memo)
        elements = rank_overlap(offset + starts - lo * S, offset + ends - lo * S, S, hi - lo + 1)
        cut = memo[key] = density * elements
    return cut
