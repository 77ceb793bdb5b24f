"""Baselines: hand-computed cases, DeepSpeed's alignment rule, and brute-force property checks."""

from __future__ import annotations

import itertools
import math

import pytest
from _strategies import grids
from _tier import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from blockshard._errors import PlanError
from blockshard.planner._baselines import (
    BASELINES,
    baseline,
    combine,
    progression_split_count,
    progression_splits,
)
from blockshard.planner._items import PlanItem
from blockshard.semantics import TensorSpec, UnitGrid


def item(name: str, shape: tuple[int, ...], grid: UnitGrid | None = None, cost: float = 0.0) -> PlanItem:
    n = math.prod(shape)
    return PlanItem(TensorSpec(name=name, shape=shape), grid or UnitGrid.units(n, 1), cost)


# -- hand-computed cases --------------------------------------------------------------------------
def test_fsdp2_rows_case():
    # (10, 8) at W=4: chunk = 3 rows, every rank padded to 3 rows -> 4*3*8 = 96 allocated.
    # Boundaries at rows 3, 6, 9 = offsets 24, 48, 72; rows:2 units are 16 elements: 24 and 72
    # fall inside units, 48 is a unit boundary.
    r = baseline("fsdp2", [item("w", (10, 8), UnitGrid.units(80, 16))], 4)
    assert (r.total_numel, r.padded_numel, r.per_rank_numel) == (80, 96, 24)
    assert r.padding_fraction == pytest.approx(16 / 96)
    assert r.splits_units == 2
    assert not r.block_respecting and r.num_collectives == 1


def test_fsdp2_llama_k_proj_half_padding():
    # Llama-3-70B k_proj (1024 x 8192) at W=1000: 2 rows x 1000 ranks, ~half of it padding.
    r = baseline("fsdp2", [item("k", (1024, 8192))], 1000)
    assert r.padded_numel == 2000 * 8192 and r.per_rank_numel == 2 * 8192
    assert r.padding_fraction == pytest.approx(976 / 2000)
    assert r.splits_units == 0  # elementwise units are never split


def test_fsdp2_vectors_and_scalars():
    # 1-D: rows are elements; 0-d: one row. W=3: ceil(7/3)=3 -> 9 allocated; scalar -> 3 allocated.
    r = baseline("fsdp2", [item("b", (7,)), item("s", ())], 3)
    assert (r.total_numel, r.padded_numel, r.per_rank_numel) == (8, 12, 4)


def test_zero3_flat_partition():
    # ceil(80/4) = 20: boundaries 20, 40, 60 each inside a 16-element unit.
    r = baseline("zero3", [item("w", (10, 8), UnitGrid.units(80, 16))], 4)
    assert (r.padded_numel, r.per_rank_numel, r.splits_units) == (80, 20, 3)
    r = baseline("zero3", [item("a", (5,)), item("b", (3, 3))], 4)
    assert (r.padded_numel, r.per_rank_numel) == (4 * 2 + 4 * 3, 5)


def test_zero12_alignment_is_two_times_world_size():
    # DeepSpeed 0.19.8: nccl_start_alignment_factor = 2, flat buffer padded to a multiple of 2*W.
    # 10 elements at W=4 -> 16 (not 12), partitions of 4.
    for dtype in ("bfloat16", "float32"):  # the factor is hard-coded, whatever the dtype
        it = PlanItem(TensorSpec(name="a", shape=(10,), dtype=dtype), UnitGrid.units(10, 1), 0.0)
        r = baseline("zero12", [it], 4)
        assert (r.padded_numel, r.per_rank_numel) == (16, 4)
        assert r.padding_fraction == pytest.approx(6 / 16)
    assert baseline("zero12", [item("a", (16,))], 4).padded_numel == 16


def test_zero12_measured_case_256_blocks_straddle():
    # A 1000x1000 matrix + 3-element bias (1,000,003 elements) with 256-element 8-bit state blocks.
    items = [item("w", (1000, 1000), UnitGrid.units(10**6, 256)), item("b", (3,), UnitGrid.whole(3))]
    r2 = baseline("zero12", items, 2)
    # padded to a multiple of 4: 1,000,004; partition 500,002 = 1953*256 + 34 -> one block split.
    assert (r2.padded_numel, r2.per_rank_numel, r2.splits_units) == (1_000_004, 500_002, 1)
    r4 = baseline("zero12", items, 4)
    # multiple of 8: 1,000,008; partitions 250,002: boundaries 250002, 500004, 750006 all mid-block.
    assert (r4.padded_numel, r4.per_rank_numel, r4.splits_units) == (1_000_008, 250_002, 3)
    # The naive rule keeps every block whole.
    assert baseline("naive", items, 4).splits_units == 0


def test_zero12_boundary_in_next_tensor_and_on_tensor_start():
    # a: 6 elements, b: 10 elements (units of 5), W=2: total 16, partition 8 -> boundary at 8 = b+2.
    items = [item("a", (6,)), item("b", (10,), UnitGrid.units(10, 5))]
    assert baseline("zero12", items, 2).splits_units == 1
    # a: 8 elements: boundary exactly at b's start -> no split, even for a whole b.
    items = [item("a", (8,)), item("b", (8,), UnitGrid.whole(8))]
    assert baseline("zero12", items, 2).splits_units == 0


def test_naive_pads_to_whole_units():
    # 5 units of 16 at W=4: 2 units per rank -> slot 32, 128 allocated.
    r = baseline("naive", [item("w", (10, 8), UnitGrid.units(80, 16))], 4)
    assert (r.padded_numel, r.per_rank_numel, r.splits_units, r.block_respecting) == (128, 32, 0, True)
    # Whole tensor: one unit, every rank reserves the whole tensor.
    r = baseline("naive", [item("m", (4, 4), UnitGrid.whole(16))], 3)
    assert (r.padded_numel, r.per_rank_numel) == (48, 16)


def test_naive_min_cut_grid_uses_actual_unit_sizes():
    # 10000 elements, 256-blocks, no piece below 4096: units 4096, 7 x 256, 4112 (9 units).
    g = UnitGrid.units(10000, 256, min_piece=4096)
    assert g.num_units == 9
    r = baseline("naive", [item("w", (10000,), g)], 2)
    # k = 5: rank 0 holds 4096 + 4*256 = 5120, rank 1 holds 3*256 + 4112 = 4880 -> slot 5120.
    assert (r.per_rank_numel, r.padded_numel) == (5120, 10240)


def test_combine_sums_groups():
    a = baseline("fsdp2", [item("w", (10, 8))], 4)
    b = baseline("fsdp2", [item("v", (7,))], 4)
    c = combine([a, b])
    assert (c.total_numel, c.padded_numel, c.per_rank_numel) == (87, 96 + 8, 24 + 2)
    assert c.padding_fraction == pytest.approx(17 / 104)
    assert c.num_collectives == 2 and c.name == "fsdp2"
    with pytest.raises(PlanError, match="world_size"):
        combine([a, baseline("fsdp2", [item("v", (7,))], 2)])
    with pytest.raises(PlanError):
        combine([])


def test_empty_group_and_zero_size_tensors():
    for name in BASELINES:
        r = baseline(name, [], 4)
        assert (r.total_numel, r.padded_numel, r.padding_fraction, r.splits_units) == (0, 0, 0.0, 0)
        r = baseline(name, [item("e", (0, 5)), item("f", (5, 0))], 4)
        assert r.padded_numel == 0 and r.padding_fraction == 0.0


def test_bad_input_names_the_parameter():
    with pytest.raises(PlanError, match=r"world_size=0.*>= 1"):
        baseline("fsdp2", [item("w", (4,))], 0)
    with pytest.raises(PlanError, match=r"baseline='fsdp1'.*fsdp2.*zero3.*zero12.*naive"):
        baseline("fsdp1", [item("w", (4,))], 2)
    with pytest.raises(ValueError):
        baseline("zero3", [item("w", (4,))], 2.0)  # type: ignore[arg-type]


def test_large_world_many_tensors():
    # 2000 tensors, 256-element blocks, W = 16384: per-tensor boundaries are progressions.
    items = [
        item(f"t{i}", (1000 + i, 4096 + 8 * (i % 7)), UnitGrid.units((1000 + i) * (4096 + 8 * (i % 7)), 256))
        for i in range(2000)
    ]
    for name in BASELINES:
        r = baseline(name, items, 16384)
        assert r.padded_numel >= r.total_numel
        assert r.per_rank_numel * 16384 == r.padded_numel


# -- brute force --------------------------------------------------------------------------------
def _units(grid: UnitGrid) -> list[tuple[int, int]]:
    cuts = [0] + [x for x in range(1, grid.numel) if grid.allows_cut(x)] + [grid.numel]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


def _count_split(grid: UnitGrid, boundaries) -> int:
    return len({(a, b) for x in boundaries for a, b in _units(grid) if a < x < b})


def _brute(name: str, items: list[PlanItem], w: int) -> tuple[int, int]:
    """(padded_numel, splits_units) by enumeration."""
    if name in ("fsdp2", "zero3"):
        padded = splits = 0
        for it in items:
            if name == "fsdp2":
                shape = it.spec.shape or (1,)
                row = math.prod(shape[1:])
                step = -(-shape[0] // w) * row
            else:
                step = -(-it.numel // w)
            padded += w * step
            splits += _count_split(it.grid, range(step, it.numel, step) if step else [])
        return padded, splits
    if name == "zero12":
        total = sum(it.numel for it in items)
        padded = -(-total // (2 * w)) * 2 * w
        part = padded // w
        splits, start = 0, 0
        for it in items:
            splits += _count_split(it.grid, [k * part - start for k in range(1, w)])
            start += it.numel
        return padded, splits
    padded = 0
    for it in items:
        us = _units(it.grid)
        k = max(1, -(-len(us) // w))
        slot = max((sum(b - a for a, b in us[i : i + k]) for i in range(0, len(us), k)), default=0)
        padded += w * slot
    return padded, 0


@st.composite
def groups(draw) -> list[PlanItem]:
    out = []
    for i in range(draw(st.integers(0, 4))):
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
        out.append(item(f"t{i}", shape, draw(grids(math.prod(shape)))))
    return out


@settings(max_examples=examples(300), deadline=None)
@given(groups(), st.integers(1, 12), st.sampled_from(BASELINES))
def test_matches_brute_force(items, w, name):
    r = baseline(name, items, w)
    padded, splits = _brute(name, items, w)
    assert (r.padded_numel, r.splits_units) == (padded, splits)
    assert r.total_numel == sum(it.numel for it in items)
    assert r.padded_numel >= r.total_numel
    assert r.per_rank_numel * w == r.padded_numel
    assert r.block_respecting == (name == "naive")
    if name == "naive":
        assert r.splits_units == 0


@settings(max_examples=examples(500), deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 5000), st.integers(0, 10**6), st.integers(1, 10**6 + 2), st.booleans())
def test_split_count_arithmetic_matches_enumeration(n, u, min_piece, step, whole):
    # The O(1) count used for fsdp2/zero3 equals the enumerated split units of the progression.
    g = UnitGrid.whole(n) if whole or n == 0 else UnitGrid.units(n, min(u, n), min_piece=min(min_piece, n))
    assert progression_split_count(g, step) == progression_splits(g, step).size
