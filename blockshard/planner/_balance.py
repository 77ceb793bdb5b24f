"""Cost balancing across groups: rotate a layout by whole segments.

[Note: rotation]
Every group gives each rank a segment of the same size, but not the same *work*: with whole
Muon matrices, identical transformer blocks pack identically, so the same ranks would own the
largest matrices of every block and do most of the Newton-Schulz FLOPs. Rotating a bucket by
``k`` segments (rank ``r``'s content moves to rank ``(r + k) % W``) keeps every invariant of the
layout — boundaries inside a tensor move by multiples of ``S_b`` — as long as no tensor spans the
wrap point, i.e. old position ``(W - k) * S_b``. Groups are planned in order (the engine's
``fully_shard`` calls come in the same order on every rank), and each picks, among its clean
rotations (evenly sampled down to ``WORK_BUDGET / loaded ranks``, at least ``MIN_CANDIDATES``),
the one that minimizes the largest accumulated cost, so the result is deterministic and every
rank computes the same layouts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from blockshard.planner._layout import GroupLayout

__all__ = [
    "balance",
    "balanced_rows",
    "best_rotation",
    "clean_rotations",
    "is_balanced",
    "rank_costs",
    "rotate",
    "rotation_peak",
    "rotations_to_try",
    "sample_rotations",
]

MIN_CANDIDATES = 32
#: Rotations tried per group are capped so that candidates x loaded ranks stays under this.
WORK_BUDGET = 1 << 17
#: A group whose per-rank cost is within this fraction of its mean is left as planned.
IMBALANCE_TOLERANCE = 0.01


def rank_costs(layout: GroupLayout, costs: Mapping[str, float]) -> np.ndarray:
    """Cost each rank carries: a tensor's cost split in proportion to the elements a rank holds."""
    out = np.zeros(layout.world_size)
    for t in layout.tensors:
        if not t.numel:
            continue
        S = layout.buckets[t.bucket]
        per_elem = costs.get(t.name, float(t.numel)) / t.numel
        r0, r1 = t.offset // S, (t.end - 1) // S
        if r0 == r1:
            out[r0] += per_elem * t.numel
            continue
        out[r0] += per_elem * ((r0 + 1) * S - t.offset)
        out[r1] += per_elem * (t.end - r1 * S)
        out[r0 + 1 : r1] += per_elem * S
    return out


def clean_rotations(layout: GroupLayout) -> np.ndarray:
    """Rotations ``k`` (in segments) under which every tensor stays contiguous in every bucket."""
    W = layout.world_size
    ts = layout.tensors
    a = np.fromiter((t.offset for t in ts), dtype=np.int64, count=len(ts))
    n = np.fromiter((t.numel for t in ts), dtype=np.int64, count=len(ts))
    s = np.fromiter((layout.buckets[t.bucket] for t in ts), dtype=np.int64, count=len(ts))
    first, last = a // s + 1, (a + n - 1) // s  # boundaries strictly inside the tensor
    inside = first <= last
    # inside[b]: boundary b (in segments) lies inside some tensor (a difference array over the ranges)
    diff = np.bincount(first[inside], minlength=W + 1) - np.bincount(last[inside] + 1, minlength=W + 1)
    covered = np.cumsum(diff[:W]) > 0
    # ok[k]: wrap point (W - k) * S_b is inside no tensor (k = 0: boundary 0, never inside)
    return np.flatnonzero(~np.concatenate((covered[:1], covered[:0:-1])))


def rotate(layout: GroupLayout, k: int) -> GroupLayout:
    if k % layout.world_size == 0:
        return layout
    W = layout.world_size
    moved = [
        dataclasses.replace(t, offset=(t.offset + k * layout.buckets[t.bucket]) % (W * layout.buckets[t.bucket]))
        for t in layout.tensors
    ]
    moved.sort(key=lambda t: (t.bucket, t.offset, t.end))  # an empty tensor before one at its offset
    return dataclasses.replace(layout, tensors=tuple(moved))


def balance(layout: GroupLayout, costs: Mapping[str, float], running: np.ndarray) -> GroupLayout:
    """Rotate ``layout`` to minimize ``max(running + its per-rank cost)``; adds its cost to ``running``."""
    base = rank_costs(layout, costs)
    k = best_rotation(layout, base, running)
    nz = np.flatnonzero(base != 0)
    running[(nz + k) % layout.world_size] += base[nz]
    return rotate(layout, k)


def best_rotation(layout: GroupLayout, base: np.ndarray, running: np.ndarray) -> int:
    """The rotation (in segments) that minimizes ``max(running + base rolled by it)``; 0 when balanced."""
    nz = np.flatnonzero(base != 0)  # ranks that carry cost: few when units are coarse
    return rotation_peak(nz, base[nz], rotations_to_try(layout, base, nz), running)[0]


def rotations_to_try(layout: GroupLayout, base: np.ndarray, nz: np.ndarray) -> np.ndarray | None:
    """The clean rotations :func:`best_rotation` compares (``None``: balanced, 0 only)."""
    if is_balanced(base):
        return None
    return sample_rotations(clean_rotations(layout), len(nz))  # ascending; 0 first when it is clean


def is_balanced(base: np.ndarray) -> bool:
    """Whether the per-rank cost ``base`` is within ``IMBALANCE_TOLERANCE`` of its mean (or one rank's)."""
    return base.size == 1 or not base.max() > base.mean() * (1 + IMBALANCE_TOLERANCE)


def balanced_rows(vals: np.ndarray, counts: np.ndarray, world_size: int) -> np.ndarray:
    """:func:`is_balanced` of the per-rank costs that are ``vals[i, :counts[i]]`` on some ranks and zero
    on the others, per row ``i`` (``vals`` padded with zeros), where their sums tell: 1 balanced, 0 not,
    -1 too close to tell (then ask :func:`is_balanced` of the whole array).

    [Note: balanced by sums] ``is_balanced`` compares the largest cost with numpy's mean times
    ``1 + IMBALANCE_TOLERANCE``; that mean is within ``1e-14`` of the mean of the absolute costs of
    the exact one (pairwise sums, one division), and so is this row sum's. Where the largest cost
    is farther than ``1e-9`` of that from the threshold, both comparisons agree."""
    if world_size == 1:
        return np.ones(len(counts), dtype=np.int8)
    real = np.arange(vals.shape[1]) < counts[:, None]
    top = np.where(real, vals, -np.inf).max(axis=1, initial=-np.inf)
    top = np.where(counts < world_size, np.maximum(top, 0.0), top)  # the ranks without cost hold 0
    scale = 1 + IMBALANCE_TOLERANCE
    gap = top - vals.sum(axis=1) / world_size * scale
    margin = 1e-9 * np.abs(vals).sum(axis=1) / world_size * scale
    return np.where(gap > margin, 0, np.where(gap < -margin, 1, -1)).astype(np.int8)


def sample_rotations(cands: np.ndarray, loaded: int) -> np.ndarray:
    """``cands`` evenly sampled down to ``WORK_BUDGET / loaded`` rotations (at least ``MIN_CANDIDATES``)."""
    limit = max(MIN_CANDIDATES, WORK_BUDGET // max(loaded, 1))
    if len(cands) > limit:
        cands = cands[np.linspace(0, len(cands) - 1, limit).astype(np.int64)]
    return cands


def rotation_peak(
    nz: np.ndarray, vals: np.ndarray, cands: np.ndarray | None, running: np.ndarray, top: float | None = None
) -> tuple[int, float]:
    """``(k, peak)``: the first rotation of ``cands`` minimizing ``max(running + vals at nz + k)``
    (``cands`` ``None``: ``k = 0``), and that peak (never below ``running.max()``, which a caller
    that asks many times passes as ``top``)."""
    W = running.size
    if top is None:
        top = running.max(initial=0.0)
    if cands is None or not len(cands):
        return 0, float(np.max(running[nz] + vals, initial=top))
    # peak of running + base rolled by k, for every candidate k, on the loaded ranks only
    if 2 * nz.size >= W:  # most ranks loaded: each rolled running is a window of running twice over,
        # over all ranks (an unloaded one adds running + 0 <= top, which no peak is below: the same peaks)
        full = np.zeros(W)
        full[nz] = vals
        windows = np.lib.stride_tricks.sliding_window_view(np.concatenate((running, running)), W)
        peaks = np.array([(windows[k] + full).max(initial=top) for k in (np.asarray(cands) % W).tolist()])
    else:
        at = np.take(running, nz[None, :] + cands[:, None], mode="wrap")  # running[(nz + k) % W]
        at += vals
        peaks = at.max(axis=1, initial=top)
    peaks = np.maximum(peaks, top)
    j = int(np.argmin(peaks))  # the first (smallest) k on ties
    return int(cands[j]), float(peaks[j])
