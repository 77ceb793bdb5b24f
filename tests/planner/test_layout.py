"""Layouts: the invariants of [Note: layout invariants], exact coverage, determinism, quality."""

from __future__ import annotations

import json
import math

import pytest
from _tier import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from blockshard import PlanError, TensorSpec, UnitGrid
from blockshard.planner import (
    GroupLayout,
    PlanItem,
    TensorPlacement,
    lower_bound,
    ordered_layout,
    pack,
    plan_group,
    plan_model,
)


def _layout(grids, W, alignment_numel=1, name="g"):
    S, offsets, lb = pack(grids, W, alignment_numel)
    tensors = tuple(
        sorted(
            (TensorPlacement(f"t{i}", (g.numel,), offsets[i], g) for i, g in enumerate(grids)), key=lambda t: t.offset
        )
    )
    return GroupLayout(name, W, alignment_numel, "float32", 4, lb, (S,), tensors)


def _assert_exact_coverage(layout: GroupLayout) -> None:
    """Every element of every tensor is held by exactly one rank, and pieces respect the grid."""
    held: dict[int, list[tuple[int, int]]] = {}
    for r in range(layout.world_size):
        used = 0
        for p in layout.pieces(r):
            t = layout.tensors[p.index]
            assert p.local_offset >= used, "pieces overlap within a segment"
            used = p.local_offset + p.numel
            assert used <= layout.segment_numel
            # the piece's position in its bucket's gathered region matches the tensor's offset
            S_b, base = layout.buckets[t.bucket], layout.bucket_local_offset(t.bucket)
            assert base <= p.local_offset and p.local_offset + p.numel <= base + S_b
            assert r * S_b + p.local_offset - base == t.offset + p.start
            assert t.grid.allows_cut(p.start) and t.grid.allows_cut(p.start + p.numel)
            held.setdefault(p.index, []).append((p.start, p.numel))
    for i, t in enumerate(layout.tensors):
        runs = sorted(held.get(i, []))
        pos = 0
        for start, n in runs:
            assert start == pos, f"{t.name}: gap or duplicate at {pos}"
            pos += n
        assert pos == t.numel, f"{t.name}: covered {pos} of {t.numel}"


@st.composite
def grids(draw):
    out = []
    for _ in range(draw(st.integers(1, 10))):
        unit = draw(st.sampled_from([1, 2, 3, 5, 8, 16, 64]))
        kind = draw(st.sampled_from(["units", "whole", "remainder", "min_piece"]))
        num = draw(st.integers(1, 40))
        if kind == "whole":
            out.append(UnitGrid.whole(unit * num))
        elif kind == "remainder":
            out.append(UnitGrid.units(unit * num + draw(st.integers(0, unit - 1)), unit))
        elif kind == "min_piece":
            out.append(UnitGrid.units(unit * num, unit, min_piece=unit * draw(st.integers(1, 4))))
        else:
            out.append(UnitGrid.units(unit * num, unit))
    return out


@settings(max_examples=examples(300), deadline=None)
@given(grids(), st.integers(1, 17), st.sampled_from([1, 2, 4, 8]))
def test_layout_invariants_hold_for_random_groups(gs, W, alignment_numel):
    layout = _layout(gs, W, alignment_numel)
    layout.check()  # equal segments, holes between tensors only, cuts on unit boundaries, aligned S
    _assert_exact_coverage(layout)
    assert layout.segment_numel >= lower_bound(gs, W, alignment_numel)


@settings(max_examples=examples(100), deadline=None)
@given(grids(), st.integers(1, 17), st.sampled_from([1, 4]))
def test_same_input_gives_same_layout_and_hash(gs, W, alignment_numel):
    a, b = _layout(gs, W, alignment_numel), _layout(list(gs), W, alignment_numel)
    assert a == b
    assert a.layout_hash() == b.layout_hash()
    again = GroupLayout.from_json(json.loads(json.dumps(a.to_json())))
    assert again == a and again.layout_hash() == a.layout_hash()


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.integers(0, 500), min_size=1, max_size=12), st.integers(1, 33), st.sampled_from([1, 2, 8]))
def test_elementwise_reaches_the_lower_bound(sizes, W, alignment_numel):
    gs = [UnitGrid.units(n, 1) for n in sizes]
    S, _, lb = pack(gs, W, alignment_numel)
    assert S == lb == -(-max(-(-sum(sizes) // W), 1) // alignment_numel) * alignment_numel


def test_whole_matrices_pack_like_bins():
    # Muon-like: matrices of 6, 4, 3, 3, 2 elements on 3 ranks: total 18, lower bound 6, and
    # first-fit decreasing packs {6}, {4, 2}, {3, 3} exactly.
    gs = [UnitGrid.whole(n) for n in (3, 6, 2, 4, 3)]
    layout = _layout(gs, 3)
    layout.check()
    assert layout.segment_numel == 6 and layout.padding_fraction == 0.0
    per_rank = [sorted(layout.tensors[p.index].numel for p in layout.pieces(r)) for r in range(3)]
    assert per_rank == [[6], [2, 4], [3, 3]]


def test_fine_units_fill_the_gaps_left_by_whole_matrices():
    # two 10-element matrices and a 6-element norm (elementwise) on 2 ranks: S = 13 would be the
    # element bound, but a matrix cannot be split, so the norm fills around them.
    gs = [UnitGrid.whole(10), UnitGrid.whole(10), UnitGrid.units(6, 1)]
    layout = _layout(gs, 2)
    layout.check()
    assert layout.segment_numel == 13
    _assert_exact_coverage(layout)


def test_hole_shifts_the_unit_grid_onto_the_boundary():
    # units of 4 on 2 ranks: 3 + 12 elements; S = 8 puts the boundary at 8, which is 5 elements into
    # the second tensor if it started at 3. A hole of 1 moves its start to 4 (boundary 4 units in).
    gs = [UnitGrid.units(3, 1), UnitGrid.units(12, 4)]
    layout = _layout(gs, 2)
    layout.check()
    t = {x.numel: x for x in layout.tensors}[12]
    assert (layout.segment_numel - t.offset) % 4 == 0


def test_min_piece_keeps_every_piece_at_least_that_large():
    # bnb8bit-like: units of 256, no piece below 4096
    g = UnitGrid.units(3 * 4096, 256, min_piece=4096)
    layout = _layout([g, UnitGrid.units(1000, 1)], 4)
    layout.check()
    for r in range(4):
        for p in layout.pieces(r):
            if layout.tensors[p.index].numel == 3 * 4096:
                assert p.numel >= 4096


def test_segment_is_a_multiple_of_every_unit_that_spans_a_segment():
    # A 64-unit tensor of 10 * 64 elements on 4 ranks covers whole segments, so S % 64 == 0
    gs = [UnitGrid.units(640, 64), UnitGrid.units(7, 1)]
    S, _, _ = pack(gs, 4, 1)
    assert S % 64 == 0 and S == 192


def test_plan_group_rejects_bad_input():
    item = PlanItem(TensorSpec(name="w", shape=(4, 4)), UnitGrid.units(16, 1), 16.0)
    with pytest.raises(PlanError, match=r"world_size=0 must be an integer >= 1"):
        plan_group([item], 0)
    with pytest.raises(PlanError, match="has no tensors"):
        plan_group([], 2, name="layers.0")
    other = PlanItem(TensorSpec(name="b", shape=(4,), dtype="float32"), UnitGrid.units(4, 1), 4.0)
    with pytest.raises(PlanError, match=r"mixes dtypes .*different groups"):
        plan_group([item, other], 2)
    with pytest.raises(PlanError, match=r"alignment_bytes=0 must be a positive integer"):
        plan_group([item], 2, alignment_bytes=0)
    with pytest.raises(PlanError, match=r"alignment_bytes=1099511627776 is more than 4096 bytes \(a page\)"):
        plan_group([item], 2, alignment_bytes=2**40)
    with pytest.raises(PlanError, match=r"alignment_bytes=8192 is more than 4096 bytes .*pass e.g. alignment_bytes=16"):
        plan_model([item.spec], 2, alignment_bytes=8192)
    assert plan_group([item], 2, alignment_bytes=4096).alignment_numel == 4096 // 2  # control: the bound (bf16)
    grids = [UnitGrid.units(100, 1)]
    for place in (pack, ordered_layout):
        with pytest.raises(PlanError, match=r"alignment_numel=1099511627776 is more than 4096 elements"):
            place(grids, 2, 2**40)
        with pytest.raises(PlanError, match=r"alignment_numel=0 must be an integer >= 1"):
            place(grids, 2, 0)
        with pytest.raises(PlanError, match=r"alignment_numel=about 2\*\*199 is more than 4096 elements"):
            place(grids, 2, 2**199)
    assert pack(grids, 2, 4096)[0] == 4096 and ordered_layout(grids, 2, 4096).segment_numel == 4096  # control


def test_plan_model_rejects_empty_and_duplicate_models():
    with pytest.raises(PlanError, match="no tensors"):
        plan_model([], 8)
    t = TensorSpec(name="w", shape=(4,))
    with pytest.raises(PlanError, match="appears twice"):
        plan_model([t, t], 8)


def test_alignment_is_in_bytes():
    items = [PlanItem(TensorSpec(name="w", shape=(10,), dtype="bfloat16"), UnitGrid.units(10, 1), 10.0)]
    layout = plan_group(items, 3, alignment_bytes=16)
    assert layout.alignment_numel == 8 and layout.segment_numel == 8
    fp32 = [PlanItem(TensorSpec(name="w", shape=(10,), dtype="float32"), UnitGrid.units(10, 1), 10.0)]
    layout = plan_group(fp32, 3, alignment_bytes=2)  # lcm(2, 4) bytes = 1 element (was 6 bytes: not a power of 2)
    assert layout.alignment_numel == 1 and layout.segment_numel == 4
    with pytest.raises(PlanError, match=r"alignment_bytes=6 must be a positive integer power of two"):
        plan_group(items, 3, alignment_bytes=6)


def test_identical_groups_get_identical_layouts_and_plan_fast():
    specs = []
    for i in range(50):
        for name, shape in (("q", (64, 48)), ("up", (96, 48)), ("norm", (48,))):
            specs.append(TensorSpec(name=f"layers.{i}.{name}", shape=shape, group=f"layers.{i}"))
    plan = plan_model(specs, 7, semantics="muon", policy="whole")  # whole matrices: rotated
    assert len({g.buckets for g in plan.groups}) == 1 and len(plan.groups) == 50
    for g in plan.groups:
        g.check()
        _assert_exact_coverage(g)
    # identical blocks are rotated against each other, so the Newton-Schulz work spreads out
    assert len({tuple(t.offset for t in g.tensors) for g in plan.groups}) > 1
    assert plan.max_cost_over_mean < 1.5
    assert plan.total_numel == sum(s.numel for s in specs)
    assert math.isclose(plan.padding_fraction, 1 - plan.total_numel / plan.padded_numel)


@settings(max_examples=examples(100), deadline=None)
@given(grids(), st.integers(1, 9))
def test_rank_loads_match_pieces(gs, W):
    layout = _layout(gs, W)
    assert layout.rank_loads() == [layout.rank_numel(r) for r in range(W)]
    assert sum(layout.rank_loads()) == layout.total_numel


@settings(max_examples=examples(150), deadline=None)
@given(grids(), st.integers(1, 12), st.sampled_from([1, 4]))
def test_bucketed_layouts_keep_every_invariant(gs, W, alignment_numel):
    """plan_group may split a group into several buckets (one collective each): still exact."""
    items = [
        PlanItem(TensorSpec(name=f"t{i}", shape=(g.numel,), dtype="float32"), g, float(g.numel))
        for i, g in enumerate(gs)
    ]
    layout = plan_group(items, W, alignment_bytes=4 * alignment_numel)
    layout.check()
    _assert_exact_coverage(layout)
    single, _, _ = pack(gs, W, alignment_numel)
    assert layout.segment_numel <= single  # buckets are used only when they save memory
    assert layout.rank_loads() == [layout.rank_numel(r) for r in range(W)]


def test_units_of_different_sizes_get_their_own_buckets():
    # Mixtral-like under Muon: stacked experts whose per-expert units differ (8 of 12, 8 of 6) and
    # some whole matrices. One bucket would need S to be a multiple of 12 *and* cover 96 + 48 + ...
    gate_up, down = UnitGrid.units(96, 12), UnitGrid.units(48, 6)
    items = [
        PlanItem(TensorSpec(name="gate_up", shape=(8, 12)), gate_up, 96.0),
        PlanItem(TensorSpec(name="q", shape=(5,)), UnitGrid.whole(5), 5.0),
        PlanItem(TensorSpec(name="down", shape=(8, 6)), down, 48.0),
        PlanItem(TensorSpec(name="norm", shape=(3,)), UnitGrid.units(3, 1), 3.0),
    ]
    layout = plan_group(items, 8, alignment_bytes=2)
    layout.check()
    _assert_exact_coverage(layout)
    single, _, _ = pack([it.grid for it in items], 8, 1)
    assert len(layout.buckets) >= 2 and layout.segment_numel < single
    assert layout.segment_numel == 12 + 6 + 5  # one expert of each, plus the small tensors
    # the gathered offsets of the buckets follow one another
    assert {layout.bucket_gathered_offset(b) for b in range(len(layout.buckets))} >= {0, 8 * layout.buckets[0]}


def test_rotation_balances_whole_matrix_work_across_groups():
    from blockshard.planner._balance import rank_costs

    specs = [
        TensorSpec(name=f"l.{i}.{n}", shape=s, group=f"l.{i}")
        for i in range(16)
        for n, s in (("up", (64, 32)), ("down", (32, 64)), ("q", (32, 32)), ("norm", (32,)))
    ]
    plan = plan_model(specs, 8, semantics="muon", policy="whole")
    costs = {it.name: it.cost for it in plan.items}
    unrotated = sum(
        rank_costs(plan_group([it for it in plan.items if it.spec.group == g.name], 8), costs) for g in plan.groups
    )
    assert unrotated.max() / unrotated.mean() > 2  # the same ranks would own every block's matrices
    assert plan.max_cost_over_mean < unrotated.max() / unrotated.mean() / 1.5
    assert plan.to_json()["max_cost_over_mean"] == plan.max_cost_over_mean


def _plan_shapes(shapes, W, semantics):
    import torch

    from blockshard.planner import resolve_items

    specs = [TensorSpec(name=f"t{i}", shape=s, dtype=torch.float32, module_type="Linear") for i, s in enumerate(shapes)]
    return plan_group(resolve_items(specs, semantics), W, name="g")


def test_a_tensor_without_elements_never_hides_the_tensor_before_it():
    """Regression: a (0, 3) tensor packed at offset 0 after a (3, 4) one made the per-rank search
    skip the (3, 4) tensor: no rank held it, and its values were lost."""
    layout = _plan_shapes([(3, 4), (3,), (0, 3)], 2, None)
    assert sum(p.numel for r in range(2) for p in layout.pieces(r)) == 15
    _assert_exact_coverage(layout)


@settings(max_examples=examples(150), deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(1, 5)), min_size=1, max_size=8),
    st.integers(1, 9),
    st.sampled_from([None, "matrix", "rows:2"]),
)
def test_tensors_without_elements_keep_exact_coverage(shapes, W, semantics):
    layout = _plan_shapes(shapes, W, semantics)
    layout.check()
    _assert_exact_coverage(layout)
