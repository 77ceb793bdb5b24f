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

import math
from dataclasses import dataclass

from blockshard._arith import run_boxes
from blockshard._errors import SemanticsError
from blockshard.semantics._grid import UnitGrid

__all__ = ["PART_NAMES", "PaddedTiles", "Tile", "TilePart", "tile_dims", "tile_parts"]

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


# [Note: padded tile order]
# A trainable master (``quantized_gather=True``) is one parameter the optimizer steps, so a rank's
# piece of it must be one contiguous run on one unit grid; the tile-major order's four parts have
# four unit sizes. The **padded tile order** gives every tile ``B x B`` values: tile ``(e, i, j)``
# of the ``(E, ceil(R / B), ceil(C / B))`` grid at ``B * B * index``, each tile row-major within
# itself, an edge tile's missing rows and columns zeros. The index runs through each expert's grid
# row by row, or column by column where only the rows have an edge (``R % B != 0 == C % B``: the
# short tiles, the last tile row, would otherwise lie together at the expert's end, and a rank whose
# run missed them would quantize more real values than the others; columns first, one in every
# ``ceil(R / B)`` tiles is short, so every run holds about its share: GPT-OSS's 2880-row experts).
# One unit size, so the layout holds it as a flat tensor of ``n_tiles * B * B`` elements
# (``UnitGrid.units``) and a rank's piece is a run of whole grid tiles, each box of tiles a box of
# the weight; its scales are one per tile in the order's tile order.
# The zeros never move: their gradient is written as zeros, element-wise steps keep a zero at zero
# (AdamW: ``m = v = 0``, update 0; decay of 0 is 0), and a tile's amax over its B * B values is its
# amax over its real ones. What it costs: the masters and their optimizer state hold the edge
# padding (``numel / real_numel()``: 1.0 where B divides every dimension).


@dataclass(frozen=True)
class PaddedTiles:
    """The padded tile order of a ``shape`` weight (2-D, or stacked ``(E, R, C)`` experts) in
    ``tile x tile`` tiles ([Note: padded tile order]); pure arithmetic."""

    shape: tuple[int, ...]
    tile: int
    stacked: bool = False

    def __post_init__(self) -> None:
        if len(self.shape) != (3 if self.stacked else 2) or not _side(self.tile):
            raise SemanticsError(
                f"a padded tile order needs a 2-D weight or a stacked (E, rows, cols) expert tensor and a tile "
                f"side >= 1, got shape {self.shape} ({'stacked' if self.stacked else 'not stacked'}), tile "
                f"{self.tile!r}"
            )

    @property
    def dims(self) -> tuple[int, int, int]:
        """``(E, R, C)``: one expert for a 2-D weight."""
        return (1, *self.shape) if not self.stacked else self.shape  # type: ignore[return-value]

    @property
    def grid_shape(self) -> tuple[int, int, int]:
        """``(E, ceil(R / B), ceil(C / B))``: one entry per tile (the scale grid, per expert)."""
        e, r, c = self.dims
        return e, -(-r // self.tile), -(-c // self.tile)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """The fp32 scale grid as the weight's ``weight_scale_inv`` has it (no expert dim for 2-D)."""
        g = self.grid_shape
        return g if self.stacked else g[1:]

    @property
    def n_tiles(self) -> int:
        return math.prod(self.grid_shape)

    @property
    def unit_numel(self) -> int:
        return self.tile * self.tile

    @property
    def numel(self) -> int:
        """Elements of the order, padding included."""
        return self.n_tiles * self.unit_numel

    @property
    def grid(self) -> UnitGrid:
        """Cuts between any two tiles."""
        return UnitGrid.units(self.numel, self.unit_numel)

    @property
    def columns_first(self) -> bool:
        """Whether the order runs through each expert's grid column by column (only the rows have an
        edge, [Note: padded tile order]); else row by row."""
        _, r, c = self.dims
        return r % self.tile != 0 and c % self.tile == 0

    @property
    def order_shape(self) -> tuple[int, int, int]:
        """The grid as the order runs through it, row-major: ``grid_shape``, its last two dims
        swapped when :attr:`columns_first`."""
        e, g_r, g_c = self.grid_shape
        return (e, g_c, g_r) if self.columns_first else (e, g_r, g_c)

    def index(self, e: int, i: int, j: int) -> int:
        """The order's index of grid tile ``(e, i, j)``."""
        _, g_1, g_2 = self.order_shape
        a, b = (j, i) if self.columns_first else (i, j)
        return (e * g_1 + a) * g_2 + b

    def tile_boxes(self, first: int, stop: int) -> list[tuple[tuple[int, int, int], tuple[int, int, int]]]:
        """``((e, i, j), (se, si, sj))`` per box of the grid that tiles ``[first, stop)`` fill, in order
        (each a box of the order's grid, its last two dims swapped back when :attr:`columns_first`)."""
        boxes: list[tuple[tuple[int, int, int], tuple[int, int, int]]] = run_boxes(self.order_shape, first, stop)  # type: ignore[assignment]
        if not self.columns_first:
            return boxes
        return [((e, i, j), (se, si, sj)) for (e, j, i), (se, sj, si) in boxes]

    def element_box(
        self, offsets: tuple[int, int, int], sizes: tuple[int, int, int]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The box of the weight (its own dims) that a box of tiles covers, edges cropped."""
        (e, i, j), (se, si, sj) = offsets, sizes
        _, r, c = self.dims
        b = self.tile
        o, s = (e, i * b, j * b), (se, min((i + si) * b, r) - i * b, min((j + sj) * b, c) - j * b)
        return (o, s) if self.stacked else (o[1:], s[1:])

    def boxes(self, first: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """``(offsets, sizes)`` of the weight's boxes that tiles ``[first, stop)`` fill (DCP's chunks)."""
        return [self.element_box(o, s) for o, s in self.tile_boxes(first, stop)]

    def real_numel(self, first: int = 0, stop: int | None = None) -> int:
        """The weight's values in tiles ``[first, stop)`` (all of them by default): no padding."""
        stop = self.n_tiles if stop is None else stop
        return sum(math.prod(s) for _, s in self.boxes(first, stop))

    def tiles_of(self, lo: int, hi: int) -> tuple[int, int]:
        """The tiles ``[first, stop)`` of elements ``[lo, hi)`` of the order (whole tiles)."""
        u = self.unit_numel
        if lo % u or hi % u:
            raise AssertionError(f"elements [{lo}, {hi}) of {self} cut a tile")
        return lo // u, hi // u
