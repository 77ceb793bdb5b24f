"""The planner's fast paths equal the plain computations they replace, on hypothesis-drawn inputs.

Each fast path was written to make the same choice, with the same floats, as a slower form:

* ``uncut`` (a closed form) as ``straddling_units`` finding none and as checking every rank
  boundary; ``uncut_at`` (on an array) as ``uncut`` at each offset;
* ``straddling_units`` (the units at the boundaries, in one pass) as the units around each
  boundary, and all of the tensor where ``every_unit_cut`` says so;
* ``_greedy_by_level`` (ranks grouped by cost, a unit's pieces as two comparison bits) as
  ``_greedy`` (one heap entry per rank) wherever ``_costs_rise`` admits it; ``by_cost``
  (``finish``'s unit order) as ``_assign``'s sort;
* ``candidate_peaks`` (every candidate's rotations in one array) as ``rotation_peak`` per candidate;
* ``clean_rotations`` (a difference array) as testing each rotation's wrap point against every tensor;
* ``fixed_costs``, ``clean_rotations_of`` and ``shift_offsets`` (every candidate's offsets at once,
  [Note: candidates by offsets]) as ``_fixed(rank_costs(...))``, ``clean_rotations`` and the
  shifts of each candidate's layout;
* ``_Held`` (a rank's units listed when first asked for) as the lists built up front;
* ``balanced_rows`` (from a row's sums, [Note: balanced by sums]) as ``is_balanced`` of the whole
  array wherever it tells.

Equality is exact (owners, rotations, peaks and costs bitwise)."""

from __future__ import annotations

import numpy as np
from _strategies import grids
from _tier import examples
from hypothesis import example, given, settings
from hypothesis import strategies as st

from blockshard.planner import GroupLayout, TensorPlacement
from blockshard.planner._balance import (
    IMBALANCE_TOLERANCE,
    balanced_rows,
    clean_rotations,
    is_balanced,
    rank_costs,
    rotation_peak,
    rotations_to_try,
)
from blockshard.planner._candidates import (
    MAX_SHIFTS,
    candidate_offsets,
    candidate_peaks,
    candidate_table,
    clean_rotations_of,
    fixed_costs,
    shift_offsets,
    with_offsets,
)
from blockshard.planner._compute import OwnerPlanBuilder
from blockshard.planner._cuts import every_unit_cut, straddling_units, uncut, uncut_at
from blockshard.planner._owner import _costs_rise, _greedy, _greedy_by_level, by_cost
from blockshard.planner._refine import _Held
from blockshard.semantics import UnitGrid


# -- uncut -------------------------------------------------------------------------------------------
@st.composite
def placed_grids(draw):
    n = draw(st.integers(0, 200))
    grid = draw(grids(n))
    S = draw(st.integers(1, 48))  # segments shorter than most tensors: several boundaries in one
    offset = draw(st.integers(0, 3 * S))
    if draw(st.booleans()) and not grid.is_whole and n:  # the first boundary on a unit edge
        offset += (-offset - grid.min_cut - grid.unit_numel * draw(st.integers(0, 4))) % S
    return grid, offset, S


@settings(max_examples=examples(500), deadline=None)
@given(placed_grids())
def test_uncut_is_no_straddling_unit_and_every_boundary_an_allowed_cut(case):
    grid, offset, S = case
    n = grid.numel
    boundaries = [k * S - offset for k in range(offset // S + 1, (offset + n - 1) // S + 1)] if n else []
    brute = all(grid.allows_cut(c) for c in boundaries)
    starts, _ = straddling_units(grid, offset, S)
    assert uncut(grid, offset, S) == (starts.size == 0) == brute


@settings(max_examples=examples(300), deadline=None)
@given(placed_grids(), st.lists(st.integers(0, 150), max_size=6))
def test_uncut_at_is_uncut_at_each_offset(case, more):
    grid, offset, S = case
    offsets = [offset, *more]
    got = uncut_at(grid, np.asarray(offsets, dtype=np.int64), S)
    assert got.tolist() == [uncut(grid, o, S) for o in offsets]


@settings(max_examples=examples(500), deadline=None)
@given(placed_grids())
def test_straddling_units_are_the_units_around_every_boundary_not_an_allowed_cut(case):
    grid, offset, S = case
    n = grid.numel
    cuts = [x for x in range(n + 1) if grid.allows_cut(x)]  # the units lie between consecutive cuts
    units = set()
    for c in [k * S - offset for k in range(offset // S + 1, (offset + n - 1) // S + 1)] if n else []:
        if not grid.allows_cut(c):
            units.add((max(x for x in cuts if x < c), min(x for x in cuts if x > c)))
    starts, ends = straddling_units(grid, offset, S)
    assert list(zip(starts.tolist(), ends.tolist(), strict=True)) == sorted(units)


@settings(max_examples=examples(500), deadline=None)
@given(placed_grids())
@example((UnitGrid.units(200, 5, min_piece=60), 0, 30))  # long end units, short middle ones
@example((UnitGrid.units(200, 40, min_piece=80), 7, 30))  # one middle unit of 40 > 30
def test_every_unit_cut_means_the_straddling_units_are_the_whole_tensor(case):
    grid, offset, S = case
    starts, ends = straddling_units(grid, offset, S)
    spans_ranks = grid.numel and offset // S < (offset + grid.numel - 1) // S
    if every_unit_cut(grid, S) and spans_ranks:
        assert int((ends - starts).sum()) == grid.numel


# -- owner greedy --------------------------------------------------------------------------------
@st.composite
def straddlers(draw):
    """Units as ``_assign`` passes them: first and last holder, their pieces, cost and segment."""
    W = draw(st.integers(1, 24))
    integral = draw(st.booleans())  # small integer costs: many ranks tie, levels are wide
    costs = [float(draw(st.integers(0, 3))) if integral else draw(st.floats(0, 10)) for _ in range(W)]
    units = []
    for _ in range(draw(st.integers(1, 40))):  # _assign returns before the greedy when none
        s = draw(st.integers(1, 16))
        ra = draw(st.integers(0, W - 1))
        rb = draw(st.integers(ra, W - 1))
        p_first = draw(st.integers(1, s))
        p_last = draw(st.integers(1, s)) if rb > ra else p_first
        c = float(draw(st.integers(1, 4))) if integral else draw(st.floats(1e-3, 5))
        units.append((ra, rb, p_first, p_last, c, s))
    units.sort(key=lambda u: -u[4])  # _assign's order: largest cost first
    return costs, units


@settings(max_examples=examples(400), deadline=None)
@given(straddlers())
def test_greedy_by_level_makes_greedys_choices(case):
    costs, units = case
    cols = [list(col) for col in zip(*units, strict=True)]
    if not _costs_rise(np.asarray(costs), np.asarray(cols[4], dtype=float)):
        return  # _assign uses _greedy itself then
    ras, rbs, firsts, lasts, ucs, ss = cols
    wants = [(f < s) | ((la > f) << 1) for f, la, s in zip(firsts, lasts, ss, strict=True)]  # as _assign
    a, b = list(costs), list(costs)
    assert _greedy_by_level(a, ras, rbs, wants, np.asarray(ucs, dtype=float)) == _greedy(b, *cols)
    assert a == b


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.0, 2.5, 7.0, 1e-300]), max_size=300), st.integers(0, 2**32 - 1))
def test_by_cost_is_assigns_sort_of_units_that_are_their_own_tensors(costs, seed):
    """``finish`` passes its units in ``_assign``'s order, sorted by cost alone (``by_cost``): its
    tensor key is the unit index, so the start never breaks a tie."""
    uc = np.asarray(costs)
    ua = np.random.default_rng(seed).integers(0, 50, uc.size)
    got = by_cost(uc)
    assert got.tolist() == np.lexsort((ua, np.arange(uc.size), -uc)).tolist()


# -- candidate peaks -----------------------------------------------------------------------------
@settings(max_examples=examples(300), deadline=None)
@given(st.integers(1, 48), st.integers(1, 8), st.integers(0, 2**32 - 1), st.booleans())
def test_candidate_peaks_equal_rotation_peak_per_candidate(W, n_cand, seed, ties):
    rng = np.random.default_rng(seed)
    running = rng.integers(0, 4, W).astype(float) if ties else rng.random(W) * 10
    top = running.max(initial=0.0)
    rows = []
    for _ in range(n_cand):  # each candidate's loaded ranks and their costs, as _table holds them
        nz = np.flatnonzero(rng.random(W) < rng.random())
        vals = rng.integers(1, 4, nz.size).astype(float) if ties else rng.random(nz.size) * 5 + 1e-3
        kind = rng.integers(3)  # None: balanced; an empty array; some clean rotations
        rots = None if kind == 0 else np.unique(rng.integers(0, W, rng.integers(0 if kind == 1 else 1, 9)))
        rows.append((nz, vals, rots))
    m = max(len(nz) for nz, _, _ in rows)
    fixed_nz = np.zeros((n_cand, m), dtype=np.int64)  # padding: rank 0, cost 0, as _table pads
    fixed_vals = np.zeros((n_cand, m))
    for i, (nz, vals, _) in enumerate(rows):
        fixed_nz[i, : nz.size], fixed_vals[i, : nz.size] = nz, vals
    within = np.flatnonzero(rng.random(n_cand) < 0.8)
    peaks, rot = candidate_peaks([rows[i][2] for i in within], within, fixed_nz, fixed_vals, running, top)
    for j, i in enumerate(within.tolist()):
        nz, vals, rots = rows[i]
        assert (int(rot[j]), float(peaks[j])) == rotation_peak(nz, vals, rots, running, top)


# -- clean rotations -----------------------------------------------------------------------------
@st.composite
def layouts(draw):
    W = draw(st.integers(1, 24))
    buckets = tuple(draw(st.lists(st.integers(1, 12), min_size=1, max_size=3)))
    tensors = []
    for b, S in enumerate(buckets):
        pos, i = 0, 0
        while True:
            pos += draw(st.integers(0, 2 * S))  # a gap (padding)
            n = draw(st.integers(0, 3 * S))
            if pos + n > W * S or draw(st.integers(0, 5)) == 0:
                break
            tensors.append(TensorPlacement(f"b{b}t{i}", (n,), pos, UnitGrid.units(n, 1), bucket=b))
            pos, i = pos + n, i + 1
    return GroupLayout("g", W, 1, "float32", 4, 1, buckets, tuple(tensors))


@settings(max_examples=examples(400), deadline=None)
@given(layouts())
def test_clean_rotations_are_those_whose_wrap_point_cuts_no_tensor(layout):
    W = layout.world_size
    ref = [
        k
        for k in range(W)
        if not any(
            t.offset < ((W - k) % W) * layout.buckets[t.bucket] < t.end for t in layout.tensors
        )  # rotation k brings old position (W - k) * S_b to 0: no tensor may run across it
    ]
    assert clean_rotations(layout).tolist() == ref


# -- candidates by offsets -----------------------------------------------------------------------
@st.composite
def candidate_cases(draw):
    """A one-bucket layout (holes between tensors, some empty), owner-computed tensors with their
    compute grids, costs of very different sizes (a rank's sum then depends on its order), and rows of
    offsets: the layout's own, its shifts and moves, and blocks (a tensor and the hole after it) in
    random orders."""
    W, S = draw(st.integers(1, 12)), draw(st.integers(1, 24))
    tensors, pos = [], 0
    for i in range(draw(st.integers(1, 7))):
        if pos > W * S:
            break
        n = draw(st.integers(0, min(3 * S, W * S - pos)))
        grid = draw(grids(n)) if draw(st.booleans()) else UnitGrid.units(n, 1)
        tensors.append(TensorPlacement(f"t{i}", (n,), pos, grid))
        pos += n + draw(st.integers(0, S))
    layout = GroupLayout("g", W, 1, "float32", 4, 1, (S,), tuple(tensors))
    compute = {t.name: draw(grids(t.numel)) for t in tensors if draw(st.booleans())}
    costs = {t.name: draw(st.sampled_from([0.0, 1.0, 3.0, 1e-9, 7e15, 0.1])) * t.numel for t in tensors}
    rows = [tuple(t.offset for t in tensors)]
    rows += [offs for offs, _ in candidate_offsets(layout, [True] * len(tensors))]
    ends = [t.offset for t in tensors[1:]] + [W * S]
    blocks = [e - t.offset for t, e in zip(tensors, ends, strict=True)]
    for _ in range(draw(st.integers(0, 4))):
        order, offs, at = draw(st.permutations(range(len(tensors)))), [0] * len(tensors), 0
        for i in order:
            offs[i], at = at, at + blocks[i]
        rows.append(tuple(offs))
    return layout, compute, costs, rows


@settings(max_examples=examples(300), deadline=None)
@given(candidate_cases())
def test_shift_offsets_of_many_bases_are_each_bases_shifts(case):
    """Every base's shifts tested in one array, as one base at a time with ``uncut`` per tensor."""
    layout, _, _, rows = case
    S, total = layout.buckets[0], layout.world_size * layout.buckets[0]
    want = []
    for base in rows:
        starts = sorted({o for t, o in zip(layout.tensors, base, strict=True) if t.numel and o})
        if len(starts) > MAX_SHIFTS:
            starts = [starts[int(i)] for i in np.linspace(0, len(starts) - 1, MAX_SHIFTS)]
        shifted = [tuple((o - d) % total for o in base) for d in starts]
        want.append([r for r in shifted if all(uncut(t.grid, o, S) for t, o in zip(layout.tensors, r, strict=True))])
    assert shift_offsets(layout, rows) == want


@settings(max_examples=examples(400), deadline=None)
@given(candidate_cases())
def test_fixed_costs_and_clean_rotations_by_offsets_equal_the_candidate_layouts(case):
    layout, compute, costs, rows = case
    fixed_nz, fixed_vals, counts = fixed_costs(layout, compute, costs, np.asarray(rows), {})
    clean = clean_rotations_of(layout, np.asarray(rows))
    builder = OwnerPlanBuilder(layout.world_size, {})
    for i, offs in enumerate(rows):
        candidate = with_offsets(layout, offs)
        b = builder._fixed(candidate, compute, costs, rank_costs(candidate, costs))
        nz = np.flatnonzero(b != 0)
        assert fixed_nz[i, : counts[i]].tolist() == nz.tolist()
        assert fixed_vals[i, : counts[i]].tobytes() == b[nz].tobytes()  # bitwise
        assert clean[i].tolist() == clean_rotations(candidate).tolist()
    table = candidate_table(layout, compute, costs, [True] * len(layout.tensors), {})
    got = table.rotations_to_try(list(range(len(table.offsets))))
    for i, offs in enumerate(table.offsets):
        b = table.fixed(i)
        want = rotations_to_try(with_offsets(layout, offs), b, np.flatnonzero(b))
        assert (got[i] is None and want is None) or got[i].tolist() == want.tolist()


# -- units held per rank (owner refinement) ------------------------------------------------------
@settings(max_examples=examples(300), deadline=None)
@given(st.integers(1, 12), st.lists(st.integers(0, 11), max_size=60), st.lists(st.integers(0, 11), max_size=8))
def test_held_lists_each_ranks_units_as_built_up_front(W, owners, asked):
    owner = np.asarray([o % W for o in owners], dtype=np.int64)
    held = _Held(owner, W)
    eager: dict[int, list[int]] = {}
    for u, o in enumerate(owner.tolist()):
        eager.setdefault(o, []).append(u)
    for r in [a % W for a in asked] + list(range(W)):  # some ranks asked first, in any order
        assert held[r] == eager.get(r, [])


# -- balanced by sums ----------------------------------------------------------------------------
@settings(max_examples=examples(400), deadline=None)
@given(st.integers(2, 40), st.integers(0, 2**32 - 1), st.sampled_from(["random", "threshold", "zeros", "residues"]))
def test_balanced_rows_agree_with_is_balanced_wherever_they_tell(W, seed, kind):
    """Rows near the threshold (the largest cost a few ulps from 1.01 x the mean), random rows with
    tiny negative residues, all-zero rows and rows of negative residues on every rank: a row's
    verdict, where given, is ``is_balanced``'s."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(6):
        n = int(rng.integers(1, W + 1))
        if kind == "threshold":  # n - 1 ranks at v, one at 1.01 x the mean
            v = float(rng.random() + 0.5)
            x = (1 + IMBALANCE_TOLERANCE) * (n - 1) * v / (W - (1 + IMBALANCE_TOLERANCE))
            for _ in range(int(rng.integers(-3, 4))):
                x = float(np.nextafter(x, np.inf))
            vals = np.full(n, v)
            vals[-1] = x
        elif kind == "zeros":
            vals = np.zeros(n)
        elif kind == "residues":  # every rank loaded, all below zero: the largest cost is negative
            vals = -rng.random(W) * 1e-12
        else:
            vals = rng.random(n) * rng.choice([1e-3, 1.0, 1e12]) - (rng.random(n) < 0.2) * 1e-9
        rows.append(vals)
    counts = np.asarray([r.size for r in rows])
    padded = np.zeros((len(rows), counts.max()))
    full = []
    for i, r in enumerate(rows):
        padded[i, : r.size] = r
        f = np.zeros(W)
        f[rng.permutation(W)[: r.size]] = r  # the loaded ranks anywhere
        full.append(f)
    told = balanced_rows(padded, counts, W)
    for t, f in zip(told.tolist(), full, strict=True):
        assert t == -1 or bool(t) == is_balanced(f)
    if kind == "random":  # clear rows are told
        assert (told >= 0).all()


def test_balanced_rows_tell_clear_rows():
    vals = np.asarray([[5.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    assert balanced_rows(vals, np.asarray([1, 2, 0]), 2).tolist() == [0, 1, -1]
