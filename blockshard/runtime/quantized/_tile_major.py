"""Row-major <-> tile-major permutations of a tiled weight ([Note: tile-major order] in
``blockshard/semantics/_tiles.py``).

:func:`to_tile_major` flattens a weight into its four parts (full tiles, right edge, bottom edge,
corner), each tile row-major within itself; :func:`from_tile_major` writes such a flattening back
into a row-major tensor (into ``out`` when given: the full weight a dequantization or an
all-gather fills anyway). Both are one strided copy per part, views elsewhere.

:class:`TileOrder` does the same for a **run of whole tiles** (what one rank holds of a
tile-placed weight, [Note: tile placement in the engine] in ``_frozen.py``): :meth:`TileOrder.put`
writes a run's values at their places in the row-major weight, :meth:`TileOrder.take` reads them,
one indexed copy per part; ``put_scales`` / ``take_scales`` do the same for one value per tile
(the fp32 scale grid ``[ceil(R / Br), ceil(C / Bc)]``), and :meth:`TileOrder.boxes` names the run
as n-D boxes of the row-major weight (DCP's chunks), with ``to_boxes`` / ``from_boxes`` between
the run's tile-major values and the boxes' row-major ones.

:class:`PackedTileOrder` is the same for the packed tile order of a trainable master ([Note:
packed tile order] in ``semantics/_tiles.py``): a run of slots, ``B x B`` values each, holding a
run of the tile-major order's tiles; it packs and unpacks them (two strided copies per part) and
goes through :class:`TileOrder` to and from the row-major weight or its boxes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from blockshard._arith import run_boxes
from blockshard.semantics._tiles import PackedTiles, Tile, TilePart, tile_dims, tile_parts

__all__ = ["PackedTileOrder", "TileOrder", "from_tile_major", "to_tile_major"]

Boxes = list[tuple[tuple[int, ...], tuple[int, ...]]]
_X = TypeVar("_X")


def _dims(shape: tuple[int, ...], stacked: bool) -> tuple[int, int, int]:
    if stacked:
        e, r, c = shape
        return e, r, c
    r, c = shape
    return 1, r, c


def _regions(w3: torch.Tensor, tile: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Views of the parts' regions of ``w3`` ``(E, R, C)``, each shaped (its part's tile index..., rows, cols)."""
    _, r, c = w3.shape
    t_r, t_c = tile
    n_r, n_c = r // t_r, c // t_c
    hr, hc = n_r * t_r, n_c * t_c
    return {
        # (E, nR, nC, Br, Bc): tile (i, j) of expert e at [e, i, j]
        "tiles": w3[:, :hr, :hc].unflatten(1, (n_r, t_r)).unflatten(3, (n_c, t_c)).permute(0, 1, 3, 2, 4),
        "right": w3[:, :hr, hc:].unflatten(1, (n_r, t_r)),  # (E, nR, Br, rc)
        "bottom": w3[:, hr:, :hc].unflatten(2, (n_c, t_c)).permute(0, 2, 1, 3),  # (E, nC, rr, Bc)
        "corner": w3[:, hr:, hc:],  # (E, rr, rc)
    }


def to_tile_major(weight: torch.Tensor, tile: Tile, *, stacked: bool) -> torch.Tensor:
    """``weight``'s values in tile-major order, 1-D (a new tensor)."""
    shape = tuple(weight.shape)
    regions = _regions(weight.reshape(_dims(shape, stacked)), tile_dims(tile))
    parts = tile_parts(shape, tile, stacked=stacked)
    return torch.cat([regions[p.name].reshape(-1) for p in parts]) if parts else weight.reshape(-1).clone()


def from_tile_major(
    flat: torch.Tensor,
    shape: tuple[int, ...],
    tile: Tile,
    *,
    stacked: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The row-major ``shape`` tensor whose tile-major flattening is ``flat`` (written into ``out``,
    a contiguous tensor of that shape, when given)."""
    if out is None:
        out = torch.empty(shape, dtype=flat.dtype, device=flat.device)
    regions = _regions(out.view(_dims(shape, stacked)), tile_dims(tile))
    for p in tile_parts(shape, tile, stacked=stacked):
        dst = regions[p.name]
        dst.copy_(flat[p.offset : p.offset + p.numel].view(dst.shape))
    return out


@dataclass(frozen=True)
class _Run:
    """The tiles ``[lo, hi)`` of one part (indices within the part) and where their values and
    their first tile lie in a run (``at`` values, ``tile_at`` tiles from the run's start)."""

    part: TilePart
    lo: int
    hi: int
    at: int
    tile_at: int


@dataclass(frozen=True)
class TileOrder:
    """The tile-major order of one weight: ``shape``, ``tile`` ``(rows, cols)``, ``stacked`` experts."""

    shape: tuple[int, ...]
    tile: tuple[int, int]
    stacked: bool = False

    @property
    def name(self) -> str:
        """How a piece in this order is named (``LocalShard.order``): ``"tile-major 128 x 128"``."""
        return f"tile-major {self.tile[0]} x {self.tile[1]}"

    @functools.cached_property
    def parts(self) -> tuple[TilePart, ...]:
        return tile_parts(self.shape, self.tile, stacked=self.stacked)

    @functools.cached_property
    def n_tiles(self) -> int:
        return sum(p.count for p in self.parts)

    @property
    def grid_shape(self) -> tuple[int, ...]:
        """The shape of one value per tile (the scale grid): ``(ceil(R / Br), ceil(C / Bc))`` per expert."""
        e, r, c = _dims(self.shape, self.stacked)
        g = (-(-r // self.tile[0]), -(-c // self.tile[1]))
        return (e, *g) if self.stacked else g

    def _n_full(self) -> tuple[int, int]:
        """Full tiles along the rows and the columns."""
        _, r, c = _dims(self.shape, self.stacked)
        return r // self.tile[0], c // self.tile[1]

    def _tile_at(self, x: int) -> int:
        """The tile whose values start at element ``x`` of the order (``n_tiles`` at the end)."""
        base = 0
        for p in self.parts:
            if x < p.offset + p.numel:
                k, rest = divmod(x - p.offset, p.unit_numel)
                if rest:
                    raise AssertionError(f"element {x} of {self} is inside a tile")
                return base + k
            base += p.count
        return base

    def tile_range(self, lo: int, hi: int) -> tuple[int, int]:
        """The tiles ``[first, stop)`` whose values are elements ``[lo, hi)`` of the order (whole tiles)."""
        return (self._tile_at(lo), self._tile_at(hi)) if lo < hi else (0, 0)

    def runs(self, first: int, stop: int) -> Iterator[_Run]:
        """Per part that tiles ``[first, stop)`` reach: its tiles there and where they lie in the run."""
        base, at = 0, 0
        for p in self.parts:
            lo, hi = max(first - base, 0), min(stop - base, p.count)
            if lo < hi:
                yield _Run(p, lo, hi, at, base + lo - first)
                at += (hi - lo) * p.unit_numel
            base += p.count

    def _lead(self, part: TilePart) -> tuple[int, ...]:
        """The tile index dims of ``part``'s region (see ``_regions``)."""
        e = _dims(self.shape, self.stacked)[0]
        n_r, n_c = self._n_full()
        return {"tiles": (e, n_r, n_c), "right": (e, n_r), "bottom": (e, n_c), "corner": (e,)}[part.name]

    def _index(self, run: _Run, device: torch.device) -> tuple[torch.Tensor, ...]:
        return torch.unravel_index(torch.arange(run.lo, run.hi, device=device), self._lead(run.part))

    def _in_grid(self, part: TilePart, lead: Sequence[_X], fixed: Callable[[int], _X]) -> tuple[_X, _X, _X]:
        """``(expert, tile row, tile column)`` in the scale grid of a lead index of ``part`` (its
        region's tile dims, see ``_lead``: offsets, sizes or index tensors). The right edge's
        column and the bottom edge's row are the last ones, ``fixed(n)`` of the ``n`` full tiles
        before them (``fixed`` gives an offset, a size of one, or a filled index)."""
        n_r, n_c = self._n_full()
        e, *rest = lead
        row = rest.pop(0) if part.name in ("tiles", "right") else fixed(n_r)
        col = rest.pop(0) if part.name in ("tiles", "bottom") else fixed(n_c)
        return e, row, col

    def _grid_index(self, run: _Run, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``(e, ti, tj)`` in the scale grid of the run's tiles."""
        idx = self._index(run, device)
        return self._in_grid(run.part, idx, lambda n: torch.full_like(idx[0], n))

    # -- values ------------------------------------------------------------------------------------
    def put(self, dst: torch.Tensor, run: torch.Tensor, first: int, stop: int) -> None:
        """Write ``run`` (the tile-major values of tiles ``[first, stop)``) into the row-major
        ``dst`` (a contiguous tensor of ``shape``): the inverse of :meth:`take`."""
        regions = _regions(dst.view(_dims(self.shape, self.stacked)), self.tile)
        at = 0
        for r in self.runs(first, stop):
            p = r.part
            values = run[r.at : r.at + (r.hi - r.lo) * p.unit_numel].view(r.hi - r.lo, p.rows, p.cols)
            regions[p.name].index_put_(self._index(r, dst.device), values)
            at = r.at + values.numel()
        if at != run.numel():
            raise AssertionError(f"{run.numel()} values are not tiles [{first}, {stop}) of {self}")

    def take(self, src: torch.Tensor, first: int, stop: int) -> torch.Tensor:
        """The tile-major values of tiles ``[first, stop)`` of the row-major ``src`` (1-D, new)."""
        regions = _regions(src.view(_dims(self.shape, self.stacked)), self.tile)
        pieces = [regions[r.part.name][self._index(r, src.device)].reshape(-1) for r in self.runs(first, stop)]
        return torch.cat(pieces) if pieces else src.new_empty(0).reshape(-1)

    def put_scales(self, grid: torch.Tensor, run: torch.Tensor, first: int) -> None:
        """Write one value per tile (``run``, tiles from ``first`` on) into ``grid`` (of ``grid_shape``)."""
        g3 = grid.view(-1, *grid.shape[-2:])
        for r in self.runs(first, first + run.numel()):
            g3.index_put_(self._grid_index(r, grid.device), run[r.tile_at : r.tile_at + r.hi - r.lo])

    def take_scales(self, grid: torch.Tensor, first: int, stop: int) -> torch.Tensor:
        """The values of tiles ``[first, stop)`` of ``grid`` in tile-major order (1-D, new)."""
        g3 = grid.view(-1, *grid.shape[-2:])
        pieces = [g3[self._grid_index(r, grid.device)] for r in self.runs(first, stop)]
        return torch.cat(pieces) if pieces else grid.new_empty(0)

    # -- boxes (DCP chunks) ------------------------------------------------------------------------
    def _run_boxes(self, r: _Run) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]]:
        """Per box of the run's part: (offsets, sizes) in elements, its sizes in tiles, its first
        tile within the part; the boxes follow the tile order."""
        t_r, t_c = self.tile
        p = r.part
        lead = self._lead(p)
        for off, size in run_boxes(lead, r.lo, r.hi):
            k = int(sum(o * math.prod(lead[i + 1 :]) for i, o in enumerate(off)))
            (e, i, j), (se, si, sj) = self._in_grid(p, off, int), self._in_grid(p, size, lambda n: 1)
            o3, s3 = (e, i * t_r, j * t_c), (se, si * p.rows, sj * p.cols)  # an edge's tiles are short
            yield (o3 if self.stacked else o3[1:]), (s3 if self.stacked else s3[1:]), size, k

    def boxes(self, first: int, stop: int) -> Boxes:
        """``(offsets, sizes)`` of the boxes of the row-major weight that tiles ``[first, stop)`` fill."""
        return [(o, s) for r in self.runs(first, stop) for o, s, _, _ in self._run_boxes(r)]

    def _box_views(self, run: torch.Tensor, first: int, stop: int) -> Iterator[tuple[torch.Tensor, tuple[int, ...]]]:
        """Per box: a permuted view of the run's tile-major values of it whose row-major order is
        the box's, and the box's sizes in elements."""
        for r in self.runs(first, stop):
            p = r.part
            for _, sizes, tiles, k in self._run_boxes(r):
                n = math.prod(tiles)
                at = r.at + (k - r.lo) * p.unit_numel
                chunk = run[at : at + n * p.unit_numel]
                if p.name == "tiles":  # (E', nR', nC', Br, Bc) -> (E', nR' Br, nC' Bc)
                    v = chunk.view(*tiles, p.rows, p.cols).permute(0, 1, 3, 2, 4)
                elif p.name == "bottom":  # (E', nC', rr, Bc) -> (E', rr, nC' Bc)
                    v = chunk.view(*tiles, p.rows, p.cols).permute(0, 2, 1, 3)
                else:  # right (E', nR', Br, rc), corner (E', rr, rc): already row-major
                    v = chunk.view(*tiles, p.rows, p.cols)
                yield v, sizes

    def to_boxes(self, run: torch.Tensor, first: int, stop: int) -> torch.Tensor:
        """The values of tiles ``[first, stop)`` (tile-major ``run``) box by box, each box row-major."""
        pieces = [v.reshape(-1) for v, _ in self._box_views(run, first, stop)]
        return torch.cat(pieces) if pieces else run.new_empty(0)

    def from_boxes(self, boxed: torch.Tensor, first: int, stop: int) -> torch.Tensor:
        """The inverse of :meth:`to_boxes`: tile-major values from box-ordered ones (1-D, new)."""
        out = boxed.new_empty(boxed.numel())
        at = 0
        for v, sizes in self._box_views(out, first, stop):
            n = math.prod(sizes)
            v.copy_(boxed[at : at + n].view(v.shape))
            at += n
        return out

    def scale_boxes(self, first: int, stop: int) -> Boxes:
        """``(offsets, sizes)`` of the boxes of the scale grid that tiles ``[first, stop)`` fill (their
        values in tile order are the boxes' row-major ones)."""
        out: Boxes = []
        for r in self.runs(first, stop):
            for off, size in run_boxes(self._lead(r.part), r.lo, r.hi):
                o3, s3 = self._in_grid(r.part, off, int), self._in_grid(r.part, size, lambda n: 1)
                out.append((o3, s3) if self.stacked else (o3[1:], s3[1:]))
        return out


@dataclass(frozen=True)
class PackedTileOrder(PackedTiles):
    """:class:`PackedTiles` with the torch copies between a run of its slots (1-D, ``B * B`` values
    per slot) and the row-major weight or the boxes of the run's tiles (each row-major, one after
    another): the run's tiles are a run of the tile-major order (:class:`TileOrder`), packed."""

    @property
    def name(self) -> str:
        """How a piece in this order is named (``LocalShard.order``)."""
        return f"packed tile-major {self.tile} x {self.tile}"

    @functools.cached_property
    def tiles(self) -> TileOrder:
        """The tile-major order the slots pack."""
        return TileOrder(self.shape, (self.tile, self.tile), self.stacked)

    def _moves(
        self, run: torch.Tensor, values: torch.Tensor, first: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(in slots, in values)``: views of the same tiles in ``run`` (slots from ``first``) and in
        ``values`` (their tile-major values), a slot's tiles at its start."""
        u = self.unit_numel
        for ps, slot, n, value, n_tiles in self.packing(first, first + run.numel() // u):
            t = ps.part.unit_numel
            slots = run[slot * u : (slot + n) * u].view(n, u)
            full = n_tiles // ps.per_slot  # slots holding per_slot tiles; the part's last may hold fewer
            take = full * ps.per_slot * t
            if full:
                yield slots[:full, : ps.per_slot * t], values[value : value + take].view(full, -1)
            if full < n:
                rest = (n_tiles - full * ps.per_slot) * t
                yield slots[full, :rest], values[value + take : value + take + rest]

    def pack(self, values: torch.Tensor, first: int, stop: int) -> torch.Tensor:
        """Slots ``[first, stop)`` (1-D, new, zeros past the tiles) from their tiles' tile-major ``values``."""
        out = values.new_zeros((stop - first) * self.unit_numel)
        self.pack_into(out, values, first)
        return out

    def pack_into(self, out: torch.Tensor, values: torch.Tensor, first: int) -> None:
        """:meth:`pack` into ``out`` (whole slots from ``first``); its zeros are written too."""
        if self.numel != self.real_numel():
            out.zero_()
        for slots, vals in self._moves(out, values, first):
            slots.copy_(vals)

    def unpack(self, run: torch.Tensor, first: int) -> torch.Tensor:
        """The tile-major values (1-D, new) of the tiles in ``run`` (slots from ``first``)."""
        values = run.new_empty(self.real_numel(first, first + run.numel() // self.unit_numel))
        for slots, vals in self._moves(run, values, first):
            vals.copy_(slots)
        return values

    def boxes(self, first: int, stop: int) -> Boxes:
        """``(offsets, sizes)`` of the boxes of the row-major weight that slots ``[first, stop)`` fill."""
        return self.tiles.boxes(*self.tile_range(first, stop))

    def put(self, dst: torch.Tensor, run: torch.Tensor, first: int) -> None:
        """Write the tiles of ``run`` (slots from ``first`` on) into the row-major ``dst``."""
        stop = first + run.numel() // self.unit_numel
        self.tiles.put(dst, self.unpack(run, first), *self.tile_range(first, stop))

    def take(self, src: torch.Tensor, first: int, stop: int) -> torch.Tensor:
        """Slots ``[first, stop)`` of the row-major ``src`` (1-D, new; zeros past the tiles)."""
        return self.pack(self.tiles.take(src, *self.tile_range(first, stop)), first, stop)

    def take_into(self, out: torch.Tensor, src: torch.Tensor, first: int) -> None:
        """:meth:`take` into ``out`` (1-D, whole slots from ``first``); its zeros are written too."""
        stop = first + out.numel() // self.unit_numel
        self.pack_into(out, self.tiles.take(src, *self.tile_range(first, stop)), first)

    def to_boxes(self, run: torch.Tensor, first: int) -> torch.Tensor:
        """The tiles of ``run`` (slots from ``first``) box by box, each box row-major
        (:meth:`boxes`), 1-D, new."""
        stop = first + run.numel() // self.unit_numel
        return self.tiles.to_boxes(self.unpack(run, first), *self.tile_range(first, stop))

    def from_boxes(self, boxed: torch.Tensor, first: int, stop: int) -> torch.Tensor:
        """The inverse of :meth:`to_boxes`: the run of slots ``[first, stop)`` (1-D, new, zeros past the tiles)."""
        return self.pack(self.tiles.from_boxes(boxed, *self.tile_range(first, stop)), first, stop)

    def scales_in_grid(self, per_tile: torch.Tensor) -> torch.Tensor:
        """Values one per tile in tile-major order (1-D, all tiles) as the scale grid (``scale_shape``)."""
        grid = per_tile.new_empty(self.scale_shape)
        self.tiles.put_scales(grid, per_tile, 0)
        return grid
