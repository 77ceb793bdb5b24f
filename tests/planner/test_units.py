"""The shared arithmetic (``blockshard._arith`` re-exported by ``blockshard.planner._units``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from blockshard import PlanError, WorldSizeError
from blockshard.planner._units import (
    block_shape,
    ceil_div,
    check_world_size,
    layout_hash,
    rank_overlap,
    round_up,
    rows_cols,
)


def test_rounding():
    assert [ceil_div(x, 4) for x in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert [round_up(x, 4) for x in (0, 1, 4, 5)] == [0, 4, 4, 8]


def test_rows_view_and_block_shape():
    assert rows_cols(()) == (1, 1) and rows_cols((7,)) == (7, 1) and rows_cols((3, 4, 5)) == (3, 20)
    assert block_shape((3, 4), 0, 12) == (3, 4)  # the whole tensor
    assert block_shape((3, 4, 5), 20, 40) == (2, 4, 5)  # whole rows keep the trailing dims
    assert block_shape((3, 4), 2, 4) == (4,)  # a flat run
    assert block_shape((3, 4), 5, 0) == (0,)
    assert block_shape((), 0, 1) == ()


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True, None])
def test_world_size_has_one_validator_and_one_message(bad):
    with pytest.raises(WorldSizeError) as info:
        check_world_size(bad, "--world-size")
    assert isinstance(info.value, PlanError) and isinstance(info.value, ValueError)
    assert str(info.value) == (
        f"--world-size={bad!r} must be an integer >= 1 (a number of ranks); pass a positive int, e.g. --world-size=8"
    )
    assert check_world_size(np.int64(3)) == 3 and type(check_world_size(np.int64(3))) is int


@given(
    st.integers(1, 9),
    st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60), st.integers(1, 7)), max_size=12),
)
def test_rank_overlap_matches_brute_force(w, raw):
    spans = []
    for a, b, s in raw:
        a, b = sorted((a % (w * s), b % (w * s + 1)))
        spans.append((a, b, s))
    want = [sum(max(0, min(b, (r + 1) * s) - max(a, r * s)) for a, b, s in spans) for r in range(w)]
    got = rank_overlap([a for a, _, _ in spans], [b for _, b, _ in spans], [s for *_, s in spans], w)
    assert got.tolist() == want and got.dtype == np.int64
    if spans:  # one segment size for all spans
        s0 = spans[0][2]
        same = [(a % (w * s0), min(b, w * s0)) for a, b, _ in spans]
        same = [(a, max(a, b)) for a, b in same]
        want0 = [sum(max(0, min(b, (r + 1) * s0) - max(a, r * s0)) for a, b in same) for r in range(w)]
        assert rank_overlap([a for a, _ in same], [b for _, b in same], s0, w).tolist() == want0


def test_layout_hash_is_canonical():
    assert layout_hash({"b": [1, 2], "a": 1}) == layout_hash({"a": 1, "b": [1, 2]})
    assert layout_hash({"a": 1}) != layout_hash({"a": 2})
    assert len(layout_hash({})) == 16
