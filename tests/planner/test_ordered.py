"""The ordered packer (``blockshard.planner.ordered_layout``, used by the DeepSpeed hook): tensors in a
fixed order, holes only between them, every partition boundary on an allowed cut."""

from __future__ import annotations

import pytest

from blockshard import PlanError, WorldSizeError
from blockshard.planner import ordered_layout
from blockshard.semantics import SemanticsRules, TensorSpec


def _grids(semantics, shapes):
    rules = SemanticsRules.coerce(semantics)
    return [rules.resolve(TensorSpec(name=f"t{i}", shape=s, dtype="float32")).grid for i, s in enumerate(shapes)]


SHAPES = [(89, 64), (89,), (130, 89), (130,), (100, 130), (100,), (7, 100), (7,), (257, 48), (48,), (3000,)]


@pytest.mark.parametrize("semantics", ["bnb8bit", "matrix", None, "ao8bit"])
@pytest.mark.parametrize("w", [1, 2, 3, 4, 7, 16])
def test_ordered_layout_boundaries_fall_on_allowed_cuts(semantics, w):
    grids = _grids(semantics, SHAPES)
    lay = ordered_layout(grids, w, 4)
    assert lay.segment_numel % 4 == 0 and lay.padded_numel == w * lay.segment_numel
    assert lay.segment_numel >= max(g.largest_unit for g in grids)
    ends = 0
    for g, s in zip(grids, lay.starts, strict=True):
        assert s % 4 == 0 and s >= ends  # in order, holes only between tensors
        ends = s + g.numel
        for b in range(lay.segment_numel, lay.padded_numel, lay.segment_numel):
            if s < b < s + g.numel:
                assert g.allows_cut(b - s), (g, s, b)
    assert ends <= lay.padded_numel
    assert sum(lay.paddings) == lay.padding_numel and min(lay.paddings) >= 0
    pieces = [p for r in range(w) for p in lay.pieces(r)]
    assert sum(p[3] for p in pieces) == lay.data_numel


def test_ordered_layout_elementwise_has_no_holes_beyond_alignment():
    lay = ordered_layout(_grids(None, [(5,), (8,), (12,)]), 2, 4)
    assert lay.starts == (0, 8, 16) and lay.segment_numel == 16


def test_ordered_layout_rejects_bad_arguments():
    grids = _grids(None, [(5,)])
    with pytest.raises(WorldSizeError, match=r"world_size=0 must be an integer >= 1"):
        ordered_layout(grids, 0)
    with pytest.raises(PlanError, match=r"alignment_numel=0 must be an integer >= 1"):
        ordered_layout(grids, 2, 0)
