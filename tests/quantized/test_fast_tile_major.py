"""The tile-major order ([Note: tile-major order] in blockshard/semantics/_tiles.py): its parts and
the torch permutations, on hypothesis-generated shapes (edge tiles of every kind, stacked experts).

Pure (no process group). A control: the row-major flattening cut at a tile boundary of the
tile-major order does not hold whole tiles (what stripe placement must avoid by cutting rows)."""

from __future__ import annotations

import math

import pytest
import torch
from _tier import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from blockshard._errors import SemanticsError
from blockshard.runtime.quantized._tile_major import PackedTileOrder, TileOrder, from_tile_major, to_tile_major
from blockshard.semantics._tiles import PART_NAMES, PackedTiles, tile_parts

shapes = st.tuples(st.integers(1, 3), st.integers(1, 40), st.integers(1, 40), st.integers(1, 12), st.booleans()).map(
    lambda t: ((t[0], t[1], t[2]) if t[4] else (t[1], t[2]), t[3], t[4])
)


def _tiles_row_major(w3: torch.Tensor, b: int) -> dict[str, list[torch.Tensor]]:
    """Every tile of ``w3`` (E, R, C), by part, in the documented order, cut by plain indexing."""
    e, r, c = w3.shape
    nr, nc = r // b, c // b
    out: dict[str, list[torch.Tensor]] = {n: [] for n in PART_NAMES}
    for x in range(e):
        for i in range(nr):
            for j in range(nc):
                out["tiles"].append(w3[x, i * b : (i + 1) * b, j * b : (j + 1) * b])
    for x in range(e):
        for i in range(nr):
            out["right"].append(w3[x, i * b : (i + 1) * b, nc * b :])
    for x in range(e):
        for j in range(nc):
            out["bottom"].append(w3[x, nr * b :, j * b : (j + 1) * b])
    for x in range(e):
        out["corner"].append(w3[x, nr * b :, nc * b :])
    return {n: [t for t in ts if t.numel()] for n, ts in out.items()}


@settings(max_examples=examples(120), deadline=None)
@given(shapes)
def test_every_tile_is_contiguous_in_its_part_and_the_order_round_trips(case):
    shape, b, stacked = case
    w = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    flat = to_tile_major(w, b, stacked=stacked)
    assert flat.shape == (w.numel(),) and torch.equal(flat.sort().values, w.reshape(-1))  # a permutation
    assert torch.equal(from_tile_major(flat, shape, b, stacked=stacked), w)
    out = torch.full(shape, -1.0, dtype=torch.float64)
    assert from_tile_major(flat, shape, b, stacked=stacked, out=out) is out and torch.equal(out, w)
    parts = tile_parts(shape, b, stacked=stacked)
    expected = _tiles_row_major(w.reshape((1, *shape) if not stacked else shape), b)
    assert [p.name for p in parts] == [n for n in PART_NAMES if expected[n]]
    assert sum(p.numel for p in parts) == w.numel() and parts[0].offset == 0
    for p in parts:
        assert p.grid.unit_numel == p.unit_numel and p.grid.numel == p.numel
        got = flat[p.offset : p.offset + p.numel].view(p.count, p.unit_numel)
        want = torch.stack([t.reshape(-1) for t in expected[p.name]])
        assert torch.equal(got, want), p  # tile k of the part: values k * unit ... (k + 1) * unit


def test_the_control_row_major_cuts_split_tiles():
    """At a 128-row weight with B = 32, a cut after the first tile of the tile-major order holds one
    whole tile; the same offset in the row-major flattening holds 8 rows of 4 tiles (none whole)."""
    w = torch.arange(128 * 128, dtype=torch.float64).reshape(128, 128)
    first = to_tile_major(w, 32, stacked=False)[: 32 * 32]
    assert torch.equal(first, w[:32, :32].reshape(-1))
    assert not torch.equal(w.reshape(-1)[: 32 * 32], w[:32, :32].reshape(-1))


def test_a_gpt_oss_shaped_expert_stack_has_full_tiles_and_a_short_bottom_edge():
    """(4, 180, 360) with B = 32 (GPT-OSS's 2880 x 5760 experts scaled down): per expert 5 full
    tile-rows of 11 full tiles and a 8-column right edge, a 20-row bottom edge and a corner."""
    parts = {p.name: (p.count, p.rows, p.cols) for p in tile_parts((4, 180, 360), 32, stacked=True)}
    assert parts == {
        "tiles": (4 * 5 * 11, 32, 32),
        "right": (4 * 5, 32, 8),
        "bottom": (4 * 11, 20, 32),
        "corner": (4, 20, 8),
    }


@pytest.mark.parametrize(
    ("shape", "tile", "stacked"), [((4, 5, 6), 2, False), ((8,), 2, False), ((3, 4), 2, True), ((3, 4), 0, False)]
)
def test_shapes_without_a_tile_major_order_are_named(shape, tile, stacked):
    with pytest.raises(SemanticsError, match=r"tile=0 must be|needs a 2-D weight or a stacked"):
        tile_parts(shape, tile, stacked=stacked)


runs = st.tuples(
    st.integers(1, 3), st.integers(1, 24), st.integers(1, 24), st.integers(1, 6), st.integers(1, 6), st.booleans()
).map(lambda t: ((t[0], t[1], t[2]) if t[5] else (t[1], t[2]), (t[3], t[4]), t[5]))


@settings(max_examples=examples(150), deadline=None)
@given(runs, st.data())
def test_a_run_of_whole_tiles_goes_to_its_places_and_its_boxes(case, data):
    """``TileOrder`` on a run of whole tiles ``[a, b)`` (what one rank holds of a tile-placed weight):
    ``take`` is the tile-major slice, ``put`` writes exactly those elements at their row-major places,
    ``boxes`` / ``to_boxes`` are boxes of the row-major weight holding those values, ``from_boxes``
    undoes it, and the scale grid's run is the same tiles (tile k's values lie in scale cell k)."""
    shape, tile, stacked = case
    order = TileOrder(shape, tile, stacked)
    w = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    flat = to_tile_major(w, tile, stacked=stacked)
    bounds = [0] + [p.offset + (k + 1) * p.unit_numel for p in order.parts for k in range(p.count)]
    a = data.draw(st.integers(0, order.n_tiles))
    b = data.draw(st.integers(a, order.n_tiles))
    lo, hi = bounds[a], bounds[b]
    assert order.tile_range(lo, hi) == ((a, b) if lo < hi else (0, 0))
    run = flat[lo:hi]
    assert torch.equal(order.take(w, a, b), run)
    dst = torch.full(shape, -1.0, dtype=torch.float64)
    order.put(dst, run, a, b)
    held = dst >= 0
    assert int(held.sum()) == run.numel() and torch.equal(dst[held], w[held])
    boxed, at = order.to_boxes(run, a, b), 0
    for offsets, sizes in order.boxes(a, b):
        n = math.prod(sizes)
        assert torch.equal(
            boxed[at : at + n].view(sizes), w[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        )
        at += n
    assert at == run.numel() and torch.equal(order.from_boxes(boxed, a, b), run)
    grid = torch.arange(math.prod(order.grid_shape), dtype=torch.float64).reshape(order.grid_shape)
    scales = order.take_scales(grid, a, b)
    at = 0
    for offsets, sizes in order.scale_boxes(a, b):
        n = math.prod(sizes)
        assert torch.equal(
            scales[at : at + n].view(sizes), grid[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        )
        at += n
    assert at == b - a
    back = torch.full_like(grid, -1.0)
    order.put_scales(back, scales, a)
    assert int((back >= 0).sum()) == b - a
    for k in range(a, b):  # tile k's first value lies in the tile whose scale is the run's k-th
        first = [int(x) for x in torch.unravel_index(torch.tensor(int(order.take(w, k, k + 1)[0])), shape)]
        first[-2] //= tile[0]
        first[-1] //= tile[1]
        assert grid[tuple(first)] == scales[k - a]


def _packed_reference(w: torch.Tensor, order: PackedTileOrder) -> torch.Tensor:
    """The packed tile order by plain loops: the full tiles, then the right edge's, the bottom
    edge's and the corners (expert by expert, row by row), each tile row-major; a part's tiles go
    ``(B * B) // tile values`` to a slot of ``B * B`` values, zeros in the rest."""
    b = order.tile
    e, r, c = (1, *w.shape) if w.dim() == 2 else w.shape
    w3 = w.reshape(e, r, c)
    n_r, n_c = r // b, c // b
    rows = [(i * b, b) for i in range(n_r)]
    cols = [(j * b, b) for j in range(n_c)]
    edge_r, edge_c = [(n_r * b, r - n_r * b)] if r % b else [], [(n_c * b, c - n_c * b)] if c % b else []
    parts = [(rows, cols), (rows, edge_c), (edge_r, cols), (edge_r, edge_c)]  # tiles, right, bottom, corner
    out = []
    for part_rows, part_cols in parts:
        tiles = [w3[x, i : i + h, j : j + v].reshape(-1) for x in range(e) for i, h in part_rows for j, v in part_cols]
        if not tiles:
            continue
        per_slot = (b * b) // tiles[0].numel()
        for k in range(0, len(tiles), per_slot):
            slot = w3.new_zeros(b * b)
            values = torch.cat(tiles[k : k + per_slot])
            slot[: values.numel()] = values
            out.append(slot)
    return torch.cat(out)


@settings(max_examples=examples(80), deadline=None)
@given(shapes, st.data())
def test_packed_tile_order_runs_round_trip_and_name_their_boxes(case, data):
    """[Note: packed tile order]: any run of slots is ``B * B`` values per slot (its tiles packed,
    zeros in the rest), put back at its places of the row-major weight, and its tiles' values box
    by box."""
    shape, b, stacked = case
    order = PackedTileOrder(shape, b, stacked)
    w = torch.arange(1, math.prod(shape) + 1, dtype=torch.float64).reshape(shape)
    full = order.take(w.reshape(-1), 0, order.n_slots)
    assert full.numel() == order.numel == order.grid.numel and order.grid.unit_numel == b * b
    assert torch.equal(full, _packed_reference(w, order)) and order.real_numel() == w.numel()
    assert order.tile_range(0, order.n_slots) == (0, order.n_tiles) == (0, math.prod(order.grid_shape))
    first = data.draw(st.integers(0, order.n_slots - 1))
    stop = data.draw(st.integers(first + 1, order.n_slots))
    run = order.take(w.reshape(-1), first, stop)
    assert torch.equal(run, full[first * b * b : stop * b * b])
    boxed = order.to_boxes(run, first)
    by_index = [
        w[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))].reshape(-1)
        for off, size in order.boxes(first, stop)
    ]
    assert torch.equal(boxed, torch.cat(by_index)) and boxed.numel() == order.real_numel(first, stop)
    assert torch.equal(order.from_boxes(boxed, first, stop), run)
    dst = torch.zeros(shape, dtype=torch.float64)
    order.put(dst.reshape(-1), run, first)
    mask = torch.zeros(shape, dtype=torch.bool)
    for off, size in order.boxes(first, stop):
        mask[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))] = True
    assert torch.equal(dst, torch.where(mask, w, 0.0))  # exactly the run's values, at their places
    assert int(mask.sum()) == order.real_numel(first, stop)
    t0, t1 = order.tile_range(first, stop)
    assert torch.equal(order.unpack(run, first), order.tiles.take(w.reshape(-1), t0, t1))


def test_packed_tile_order_of_gpt_oss_shaped_expert_tensors():
    """(4, 180, 360) in 32 x 32 tiles: 5 full tile rows and a 20-row edge per expert, 8 columns
    short at the right (GPT-OSS's 2880-row experts scaled down); and GPT-OSS-120B's own experts,
    whose 64-value edges pack two to a 128 x 128 slot: no zeros at all."""
    order = PackedTileOrder((4, 180, 360), 32, stacked=True)
    parts = [(ps.part.name, ps.per_slot, ps.n_slots) for ps in order.slots]
    # full tiles one a slot; right edge 32 x 8 four a slot; bottom edge 20 x 32 one; corners 20 x 8 six
    assert parts == [("tiles", 1, 220), ("right", 4, 5), ("bottom", 1, 44), ("corner", 6, 1)]
    assert order.n_slots == 270 and order.numel == 270 * 1024 and order.real_numel() == 4 * 180 * 360
    assert order.n_tiles == 4 * 6 * 12 and order.grid_shape == (4, 6, 12)
    assert order.tile_range(220, 222) == (220, 228)  # two slots of the right edge: eight tiles
    assert order.real_numel(219, 222) == 32 * 32 + 8 * 32 * 8
    assert order.tile_range(269, 270) == (284, 288) and order.real_numel(269, 270) == 4 * 20 * 8
    with pytest.raises(AssertionError, match="cut a slot"):
        order.slots_of(0, 1000)
    for shape in ((128, 2880, 5760), (128, 2880, 2880), (32, 2880, 2880)):  # gate_up_proj, down_proj
        assert PackedTiles(shape, 128, stacked=True).numel == math.prod(shape), shape
    with pytest.raises(SemanticsError, match="stacked"):
        PackedTiles((180, 360), 32, stacked=True)
