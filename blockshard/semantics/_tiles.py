"""The tile-major order of a ``B x B``-tiled weight: one tile as the placement unit.

[Note: tile-major order]
``fp8_block:B`` quantizes a 2-D weight ``(R, C)`` (or each expert of a stacked ``(E, R, C)``) in
``B x B`` tiles, the last row and column of tiles partial. In the row-major flattening a tile is
not contiguous, so the placement unit is a ``B``-row stripe, and once ``W`` exceeds a group's
stripes ranks hold one stripe or none (``fp8_block:128`` pads 50% on Llama-3-70B at W = 256, 82%
at W = 1024; GPT-OSS's 2880-row experts are one unit each). In a **tile-major order** every tile is
contiguous, so a rank's piece can be any run of whole tiles.

The order, with ``nR, rr = divmod(R, B)`` and ``nC, rc = divmod(C, B)``, is four **parts**, each a
run of equal tiles (so each part is an ordinary flat tensor whose :class:`UnitGrid` is its tile):

1. ``tiles``: the full ``B x B`` tiles, expert by expert, tile-row by tile-row, left to right;
2. ``right``: the right edge's ``B x rc`` tiles (expert, tile-row);
3. ``bottom``: the bottom edge's ``rr x B`` tiles (expert, tile-column);
4. ``corner``: each expert's ``rr x rc`` corner tile.

A part with no tile is left out; each tile's values are row-major within the tile. The order
depends only on the shape and ``B`` (not on ``W``), so pieces of it reshard across world sizes
like any flat tensor. :func:`tile_parts` gives the parts; the torch permutation (row-major <->
tile-major) is ``runtime/quantized/_tile_major.py``. Measured with the parts planned as flat
tensors (docs/design.md, "Tile placement"): padding 0.000% for ``fp8_block:128`` on Llama-3-70B,
GPT-OSS-120B, Mixtral-8x7B and DeepSeek-V3 at W = 8 to 1024.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from blockshard._errors import SemanticsError
from blockshard.semantics._grid import UnitGrid

__all__ = ["PART_NAMES", "PackedTiles", "Tile", "TilePart", "tile_dims", "tile_parts"]

PART_NAMES = ("tiles", "right", "bottom", "corner")

#: A tile's side ``B`` (``B x B``, the ``fp8_block:B`` semantics) or ``(rows, cols)`` (a frozen
#: FP8 module's ``block_size``).
Tile = int | tuple[int, int]


def _side(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def tile_dims(tile: object) -> tuple[int, int]:
    """``(rows, cols)`` of ``tile`` (a side or a pair), raising :class:`SemanticsError` otherwise."""
    if _side(tile):
        return tile, tile  # type: ignore[return-value]
    if isinstance(tile, (tuple, list)) and len(tile) == 2 and all(_side(x) for x in tile):
        return int(tile[0]), int(tile[1])
    raise SemanticsError(f"tile={tile!r} must be an integer >= 1 (the tile's side, e.g. 128) or a (rows, cols) pair")


@dataclass(frozen=True)
class TilePart:
    """One part of the tile-major order: ``count`` tiles of ``rows x cols`` values, from ``offset``."""

    name: str
    count: int
    rows: int
    cols: int
    offset: int  # first value of the part in the tile-major flattening

    @property
    def unit_numel(self) -> int:
        return self.rows * self.cols

    @property
    def numel(self) -> int:
        return self.count * self.unit_numel

    @property
    def grid(self) -> UnitGrid:
        """Cuts between any two tiles of the part."""
        return UnitGrid.units(self.numel, self.unit_numel)


def tile_parts(shape: tuple[int, ...], tile: Tile, *, stacked: bool) -> tuple[TilePart, ...]:
    """The parts of the tile-major order of a ``shape`` weight in ``tile x tile`` tiles (or
    ``rows x cols`` ones for a pair; [Note: tile-major order]); ``stacked``: a ``(E, R, C)`` expert
    tensor, tiled per expert."""
    t_r, t_c = tile_dims(tile)
    if len(shape) == 2 and not stacked:
        experts, (rows, cols) = 1, shape
    elif len(shape) == 3 and stacked:
        experts, rows, cols = shape
    else:
        raise SemanticsError(
            f"a tile-major order needs a 2-D weight or a stacked (E, rows, cols) expert tensor, got shape {shape} "
            f"({'stacked' if stacked else 'not stacked'}); apply fp8_block to such weights only"
        )
    n_r, r_r = divmod(rows, t_r)
    n_c, r_c = divmod(cols, t_c)
    sizes = (
        ("tiles", experts * n_r * n_c, t_r, t_c),
        ("right", experts * n_r, t_r, r_c),
        ("bottom", experts * n_c, r_r, t_c),
        ("corner", experts, r_r, r_c),
    )
    out: list[TilePart] = []
    offset = 0
    for name, count, r, c in sizes:
        if count and r and c:
            out.append(TilePart(name, count, r, c, offset))
            offset += count * r * c
    assert offset == math.prod(shape), (shape, tile, out)
    return tuple(out)


# [Note: packed tile order]
# A trainable master (``quantized_gather=True``) is one parameter the optimizer steps, so a rank's
# piece of it must be one contiguous run on one unit grid; the tile-major order's four parts have
# four unit sizes. The **packed tile order** keeps the tile-major order's parts and tile order and
# packs them into **slots** of ``B * B`` values, the unit: a full tile fills a slot; the tiles of an
# edge part (``t`` values each) go ``k = (B * B) // t`` to a slot, one after another, and the rest
# of the slot is zeros (so is the rest of a part's last slot). A part starts at a slot, so a run of
# slots is a run of whole tiles, in tile-major order. One unit size: the layout holds the master as
# a flat tensor of ``n_slots * B * B`` elements (``UnitGrid.units``), a rank's piece is a run of
# whole slots, its tiles a run of the tile-major order (boxes of the weight as for frozen tiles), its
# scales one per tile in that order.
# The zeros never move: their gradient is written as zeros, element-wise steps keep a zero at zero
# (AdamW: ``m = v = 0``, update 0; decay of 0 is 0), and a tile's amax is over its real values. What
# it costs: the masters and their optimizer state hold the zeros (``numel / real_numel()``): none
# where an edge's side divides ``B`` (GPT-OSS's 2880 = 22 * 128 + 64: two 64-row edge tiles a slot),
# at most a slot per part, and up to a whole edge's padding where it does not (a 65-row edge of
# ``B = 128``: one tile a slot, as if padded to 128 rows). An earlier **padded tile order** gave
# every edge tile a slot of its own: 1.0296x the values on GPT-OSS-120B.


@dataclass(frozen=True)
class _PartSlots:
    """One part of the packed tile order: ``per_slot`` tiles a slot, from slot ``first_slot`` and
    tile ``first_tile`` (tiles counted over the parts in order)."""

    part: TilePart
    per_slot: int
    first_slot: int
    first_tile: int

    @property
    def n_slots(self) -> int:
        return -(-self.part.count // self.per_slot)

    def tile_of(self, slot: int) -> int:
        """The first tile of ``slot`` (relative to the part: ``0 <= slot <= n_slots``)."""
        return min(slot * self.per_slot, self.part.count)


@dataclass(frozen=True)
class PackedTiles:
    """The packed tile order of a ``shape`` weight (2-D, or stacked ``(E, R, C)`` experts) in
    ``tile x tile`` tiles ([Note: packed tile order]); pure arithmetic. Its unit is a slot."""

    shape: tuple[int, ...]
    tile: int
    stacked: bool = False

    def __post_init__(self) -> None:
        if len(self.shape) != (3 if self.stacked else 2) or not _side(self.tile):
            raise SemanticsError(
                f"a packed tile order needs a 2-D weight or a stacked (E, rows, cols) expert tensor and a tile "
                f"side >= 1, got shape {self.shape} ({'stacked' if self.stacked else 'not stacked'}), tile "
                f"{self.tile!r}"
            )

    @functools.cached_property
    def slots(self) -> tuple[_PartSlots, ...]:
        """The parts (those with tiles), each with where its slots and tiles start."""
        out: list[_PartSlots] = []
        slot = tile = 0
        for p in tile_parts(self.shape, self.tile, stacked=self.stacked):
            ps = _PartSlots(p, self.unit_numel // p.unit_numel, slot, tile)
            out.append(ps)
            slot, tile = slot + ps.n_slots, tile + p.count
        return tuple(out)

    @property
    def unit_numel(self) -> int:
        return self.tile * self.tile

    @property
    def n_slots(self) -> int:
        return sum(ps.n_slots for ps in self.slots)

    @property
    def n_tiles(self) -> int:
        return sum(ps.part.count for ps in self.slots)

    @property
    def numel(self) -> int:
        """Elements of the order, its zeros included."""
        return self.n_slots * self.unit_numel

    @property
    def grid(self) -> UnitGrid:
        """Cuts between any two slots."""
        return UnitGrid.units(self.numel, self.unit_numel)

    @property
    def grid_shape(self) -> tuple[int, int, int]:
        """``(E, ceil(R / B), ceil(C / B))``: one entry per tile (the scale grid, per expert)."""
        e, r, c = (1, *self.shape) if not self.stacked else self.shape
        return e, -(-r // self.tile), -(-c // self.tile)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """The fp32 scale grid as the weight's ``weight_scale_inv`` has it (no expert dim for 2-D)."""
        g = self.grid_shape
        return g if self.stacked else g[1:]

    def tile_at(self, slot: int) -> int:
        """The first tile (over the parts, in tile-major order) of ``slot``; ``n_tiles`` at the end."""
        for ps in self.slots:
            if slot < ps.first_slot + ps.n_slots:
                return ps.first_tile + ps.tile_of(max(slot - ps.first_slot, 0))
        return self.n_tiles

    def tile_range(self, first: int, stop: int) -> tuple[int, int]:
        """The tiles ``[t0, t1)`` (tile-major order) that slots ``[first, stop)`` hold."""
        return (self.tile_at(first), self.tile_at(stop)) if first < stop else (0, 0)

    def slots_of(self, lo: int, hi: int) -> tuple[int, int]:
        """The slots ``[first, stop)`` of elements ``[lo, hi)`` of the order (whole slots)."""
        u = self.unit_numel
        if lo % u or hi % u:
            raise AssertionError(f"elements [{lo}, {hi}) of {self} cut a slot")
        return lo // u, hi // u

    def real_numel(self, first: int = 0, stop: int | None = None) -> int:
        """The weight's values in slots ``[first, stop)`` (all of them by default): no zeros."""
        stop = self.n_slots if stop is None else stop
        out = 0
        for ps in self.slots:
            lo = ps.tile_of(min(max(first - ps.first_slot, 0), ps.n_slots))
            hi = ps.tile_of(min(max(stop - ps.first_slot, 0), ps.n_slots))
            out += (hi - lo) * ps.part.unit_numel
        return out

    def packing(self, first: int, stop: int) -> list[tuple[_PartSlots, int, int, int, int]]:
        """Per part that slots ``[first, stop)`` reach: ``(part, slot, n_slots, value, n_tiles)``: its
        slots start ``slot`` slots into the run, its tiles ``value`` values into the run's tile-major
        values; every slot holds ``per_slot`` tiles but the part's last."""
        out = []
        slot_at = value_at = 0
        for ps in self.slots:
            lo, hi = max(first - ps.first_slot, 0), min(stop - ps.first_slot, ps.n_slots)
            if lo < hi:
                n_tiles = ps.tile_of(hi) - ps.tile_of(lo)
                out.append((ps, slot_at, hi - lo, value_at, n_tiles))
                slot_at, value_at = slot_at + hi - lo, value_at + n_tiles * ps.part.unit_numel
        return out
