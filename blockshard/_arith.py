"""Integer arithmetic shared by every layer: rounding, and the rows view of a tensor.

This is the bottom of the dependency stack: it imports nothing from blockshard, so
``semantics`` (which must not import ``planner``) and everything above can use it.
:mod:`blockshard.planner._units` re-exports these helpers next to the planner-level ones
(world-size validation, per-rank overlap, layout hashes); code above ``semantics`` imports
them from there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["block_shape", "ceil_div", "round_up", "rows_cols", "run_boxes"]


def ceil_div(x: int, m: int) -> int:
    """``ceil(x / m)`` for integers (``m >= 1``), without floats."""
    return -(-x // m)


def round_up(x: int, m: int) -> int:
    """The smallest multiple of ``m`` that is ``>= x`` (``m >= 1``)."""
    return -(-x // m) * m


def rows_cols(shape: Sequence[int]) -> tuple[int, int]:
    """The rows view of a tensor: ``(shape[0], prod(shape[1:]))``, i.e. ``(rows, elements per row)``.

    A 1-D tensor is a column (``(n, 1)``); a 0-d tensor is one row of one element. Row-based block
    semantics, FSDP2's ``Shard(0)`` (``torch.chunk`` along dim 0) and the block shape below all use it.
    """
    if len(shape) == 0:
        return 1, 1
    return shape[0], math.prod(shape[1:])


def block_shape(shape: Sequence[int], start: int, numel: int) -> tuple[int, ...]:
    """The shape an optimizer sees for elements ``[start, start + numel)`` of a tensor of ``shape``.

    The whole tensor keeps its shape (an owned Muon matrix); whole rows of dim 0 keep the trailing
    dims (a Shampoo or FP8 stripe ``[rows, cols]``, whole experts ``[k, m, n]``); anything else is
    a flat run; an empty piece is ``(0,)``.
    """
    if numel == 0:
        return (0,)
    if start == 0 and numel == math.prod(shape):
        return tuple(shape)
    if len(shape) >= 2:
        _, row = rows_cols(shape)
        if row and start % row == 0 and numel % row == 0:
            return (numel // row, *shape[1:])
    return (numel,)


def run_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offsets, sizes)`` of the n-D boxes covering elements ``[lo, hi)`` of the row-major flattening
    of ``shape``, in order (at most ``2 * ndim - 1``): each box is contiguous in that flattening."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = -(-lo // inner), hi // inner  # whole rows [first, last)
    rest = shape[1:]
    if first > last:  # inside one row
        r = lo // inner
        return [((r, *o), (1, *s)) for o, s in run_boxes(rest, lo - r * inner, hi - r * inner)]
    out = []
    if lo < first * inner:  # the end of row first - 1
        r = first - 1
        out += [((r, *o), (1, *s)) for o, s in run_boxes(rest, lo - r * inner, inner)]
    if first < last:
        out.append(((first, *(0 for _ in rest)), (last - first, *rest)))
    if hi > last * inner:  # the start of row last
        out += [((last, *o), (1, *s)) for o, s in run_boxes(rest, 0, hi - last * inner)]
    return out
