"""Hypothesis strategies shared by the planner's property tests."""

from __future__ import annotations

from hypothesis import strategies as st

from blockshard.semantics import UnitGrid


@st.composite
def grids(draw, n: int) -> UnitGrid:
    kind = draw(st.sampled_from(["elem", "units", "minpiece", "whole"]))
    if kind == "elem":
        return UnitGrid.units(n, 1)
    if kind == "whole" or n == 0:
        return UnitGrid.whole(n)
    u = draw(st.integers(1, max(1, n)))
    mp = draw(st.integers(0, n)) if kind == "minpiece" else 0
    return UnitGrid.units(n, u, min_piece=mp)
