"""The ordered packer: a block-aligned layout of tensors in a fixed order (DeepSpeed ZeRO-1/2's).

DeepSpeed ZeRO-1/2 flattens the parameters of an optimizer ``param_group`` in a fixed order into one
buffer and gives rank ``r`` the elements ``[r*S, (r+1)*S)``. This module chooses where each
parameter starts (holes only *between* parameters, as DeepSpeed's own ``parameter_alignment``
padding) and the partition size ``S`` so that every partition boundary ``k*S`` falls on an allowed
cut of the parameter it crosses (:meth:`blockshard.semantics.UnitGrid.allows_cut`): 256-element
multiples and no piece below 4096 elements for ``bnb8bit``, never inside a matrix for ``matrix``.

Unlike :func:`blockshard.planner.plan_group` it keeps the given order (DeepSpeed's gradient hooks,
``round_robin`` reordering and checkpoints all key on it) and only inserts holes. It lives in the
planner (pure, no process group); :mod:`blockshard.integrations.deepspeed` applies it.

Algorithm (deterministic, so every rank computes the same layout): ``S`` starts at the lower bound
``max(ceil(total / W), largest unit)`` rounded up to the step (the alignment, times the common unit
of the split-able parameters when that is small against ``S``, so that multi-boundary parameters can
line up). Parameters are placed greedily in order at the first aligned start from which every
boundary they cross is an allowed cut; a start that fails moves forward just far enough to make
the first failing cut allowed (or to the boundary itself). If the parameters do not fit in
``W * S``, ``S`` grows (by the shortfall over ``W``, at least one step and ``S / 512``) and the
placement is redone. ``S >= n`` always fits a tensor of ``n`` elements (start it on a boundary),
so the search ends.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from blockshard.planner._units import ceil_div, check_alignment_numel, check_world_size, round_up
from blockshard.semantics import UnitGrid

__all__ = ["OrderedLayout", "ordered_layout"]


@dataclass(frozen=True)
class OrderedLayout:
    """Starts of the tensors (in the given order) in a buffer of ``world_size * segment_numel`` elements.

    ``to_json`` keeps the keys ``"segment"`` and ``"align"`` (elements): DeepSpeed checkpoints store it.
    """

    world_size: int
    segment_numel: int  # S: elements per rank
    alignment_numel: int  # every start and S are multiples of it
    numels: tuple[int, ...]
    starts: tuple[int, ...]

    @property
    def padded_numel(self) -> int:
        """``W * S``: the whole buffer, padding included."""
        return self.world_size * self.segment_numel

    @property
    def data_numel(self) -> int:
        return sum(self.numels)

    @property
    def padding_numel(self) -> int:
        return self.padded_numel - self.data_numel

    @property
    def paddings(self) -> list[int]:
        """Holes after each tensor (DeepSpeed's ``param_padding``); the last one runs to the end."""
        ends = [s + n for s, n in zip(self.starts, self.numels, strict=True)]
        nxt = list(self.starts[1:]) + [self.padded_numel]
        return [b - e for e, b in zip(ends, nxt, strict=True)]

    def pieces(self, rank: int) -> list[tuple[int, int, int, int]]:
        """``(tensor index, offset in tensor, offset in rank's segment, numel)`` of every piece rank holds."""
        lo, hi = rank * self.segment_numel, (rank + 1) * self.segment_numel
        out = []
        for t, (s, n) in enumerate(zip(self.starts, self.numels, strict=True)):
            a, b = max(s, lo), min(s + n, hi)
            if a < b:
                out.append((t, a - s, a - lo, b - a))
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "segment": self.segment_numel,
            "align": self.alignment_numel,
            "numels": list(self.numels),
            "starts": list(self.starts),
        }


def _place(grid: UnitGrid, start: int, seg: int, align: int, limit: int) -> int | None:
    """The first start >= ``start`` (a multiple of ``align``) whose boundary crossings are allowed cuts."""
    n = grid.numel
    start = round_up(start, align)
    while start + n <= limit:
        if n == 0:
            return start
        b = (start // seg + 1) * seg  # first boundary strictly after start
        bad = None
        while b < start + n:
            if not grid.allows_cut(b - start):
                bad = b
                break
            b += seg
        if bad is None:
            return start
        off = bad - start
        if grid.is_whole or off < grid.min_cut:
            new = bad  # start the tensor at the boundary
        else:
            cut = min(grid.max_cut, (off // grid.unit_numel) * grid.unit_numel)
            new = bad - cut if cut >= grid.min_cut else bad
        start = round_up(max(new, start + 1), align)
    return None


def ordered_layout(grids: Sequence[UnitGrid], world_size: int, alignment_numel: int = 1) -> OrderedLayout:
    """Lay out ``grids`` in order on ``world_size`` ranks, boundaries on allowed cuts (see the module doc)."""
    world_size = check_world_size(world_size)
    align = check_alignment_numel(alignment_numel)
    grids = list(grids)
    numels = tuple(g.numel for g in grids)
    total = sum(numels)
    largest = max((g.largest_unit for g in grids), default=1)
    seg = round_up(max(ceil_div(total, world_size), largest, 1), align)
    units = [g.unit_numel for g in grids if not g.is_whole and g.unit_numel > 1]
    step = align
    if units:
        common = math.lcm(align, *units)
        if common * 8 <= seg:
            step = common
    seg = round_up(seg, step)
    while True:
        limit = world_size * seg
        starts: list[int] = []
        pos = 0
        for g in grids:
            s = _place(g, pos, seg, align, limit)
            if s is None:
                break
            starts.append(s)
            pos = s + g.numel
        if len(starts) == len(grids):
            return OrderedLayout(world_size, seg, align, numels, tuple(starts))
        # Did not fit: grow S by the shortfall spread over the ranks (at least one step, at least
        # 1/512 of S, so the search stays short for large groups and tight for small ones).
        deficit = pos + sum(numels[len(starts) :]) - limit
        grow = max(step, ceil_div(max(deficit, 0), world_size), seg // 512)
        seg = round_up(seg + grow, step)
