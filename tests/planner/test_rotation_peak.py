"""``rotation_peak`` ([Note: rotation] in planner/_balance.py): the peak of ``running`` plus a
group's per-rank cost rolled by each candidate rotation, and the first rotation reaching the lowest.

Oracle: ``np.roll`` of the full cost vector for every candidate, one at a time. The fast paths (a
window of ``running`` twice over when most ranks are loaded, an index gather otherwise) must give
the same rotation and the same peak, bitwise, for dense and sparse loads, ties included."""

from __future__ import annotations

import numpy as np
from _tier import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from blockshard.planner._balance import rotation_peak


def _oracle(nz, vals, cands, running):
    W = running.size
    base = np.zeros(W)
    base[nz] = vals
    top = running.max(initial=0.0)
    peaks = [max(float((running + np.roll(base, int(k))).max(initial=top)), float(top)) for k in cands]
    j = int(np.argmin(peaks))
    return int(cands[j]), peaks[j]


@settings(max_examples=examples(200), deadline=None)
@given(
    st.integers(1, 64),
    st.floats(0.0, 1.0),
    st.integers(1, 12),
    st.integers(0, 2**32 - 1),
    st.booleans(),
)
def test_the_fast_paths_equal_rolling_every_candidate(W, density, n_cands, seed, ties):
    rng = np.random.default_rng(seed)
    running = rng.integers(0, 4, W).astype(float) if ties else rng.random(W) * 10
    loaded = rng.random(W) < density
    loaded[rng.integers(W)] = True  # at least one loaded rank
    nz = np.flatnonzero(loaded)
    vals = rng.integers(1, 4, nz.size).astype(float) if ties else rng.random(nz.size) * 5 + 1e-3
    cands = np.unique(rng.integers(0, W, n_cands))
    assert rotation_peak(nz, vals, cands, running) == _oracle(nz, vals, cands, running)
    assert rotation_peak(nz, vals, None, running) == _oracle(nz, vals, np.array([0]), running)
