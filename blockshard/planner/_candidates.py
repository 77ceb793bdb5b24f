"""A group's candidate layouts -- its tensor shifts and moves -- held as offsets, not layouts.

[Note: candidates by offsets]
``OwnerPlanBuilder._best_shift`` (``_compute.py``) compares a group against its tensor shifts
([Note: shifts] in ``_compute.py``) and moves ([Note: tensor moves] in ``_moves.py``): about 1,200
candidates for a DeepSeek-V3 block. A candidate differs from its group only in its tensors'
offsets, so each is kept as one row of offsets (per tensor of the group), and what the search
needs of them is computed from all rows at once, with the same floats as from the candidate's
layout:

* the fixed cost per rank, ``_fixed(rank_costs(candidate))``: the proportional cost per rank less
  the cut units' (:func:`fixed_costs`);
* its clean rotations, as ``clean_rotations(candidate)`` (:func:`clean_rotations_of`).

A candidate's layout is built only once it is picked. Candidates exist for one-bucket layouts only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from blockshard.planner._balance import balanced_rows, is_balanced, sample_rotations
from blockshard.planner._cuts import cut_cost_per_rank, every_unit_cut, uncut, uncut_at
from blockshard.planner._layout import GroupLayout, TensorPlacement
from blockshard.planner._moves import tensor_moves
from blockshard.planner._units import Memo
from blockshard.semantics import UnitGrid

__all__ = [
    "MAX_SHIFTS",
    "CandidateTable",
    "candidate_peaks",
    "candidate_table",
    "clean_rotations_of",
    "fixed_costs",
    "shift_offsets",
    "with_offsets",
]

#: At most this many shifts ([Note: shifts] in ``_compute.py``) are tried per distinct group layout.
MAX_SHIFTS = 16
#: Candidates' peaks are computed this many (rank, rotation) values at a time (``candidate_peaks``).
PEAK_CHUNK = 1 << 20
#: Clean rotations are listed for this many (candidate, rotation) values at a time at most.
ROTATION_CHUNK = 1 << 22
_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY_F = np.zeros(0)


# with_offsets builds placements field by field: a field added to TensorPlacement must be added there
assert [f.name for f in dataclasses.fields(TensorPlacement)] == [
    "name",
    "shape",
    "offset",
    "grid",
    "semantics",
    "bucket",
]


def with_offsets(layout: GroupLayout, offsets: tuple[int, ...]) -> GroupLayout:
    """``layout`` with tensor ``i`` at ``offsets[i]``."""
    moved = [  # the constructor: dataclasses.replace is 5x slower
        TensorPlacement(t.name, t.shape, o, t.grid, t.semantics, t.bucket)
        for t, o in zip(layout.tensors, offsets, strict=True)
    ]
    moved.sort(key=lambda t: (t.bucket, t.offset, t.end))  # an empty tensor before one at its offset
    return dataclasses.replace(layout, tensors=tuple(moved))


def shift_offsets(layout: GroupLayout, bases: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """Offsets (per tensor of ``layout``) of the tensor shifts ([Note: shifts] in ``_compute.py``) of
    ``layout`` with tensor ``i`` at ``base[i]``, per base: every base's shifts tested at once."""
    S = layout.buckets[0]
    total = layout.world_size * S
    live = [t.numel > 0 for t in layout.tensors]
    rows, owner = [], []  # every (base, start) tried, and its base
    for b, offsets in enumerate(bases):
        starts = sorted({o for keep, o in zip(live, offsets, strict=True) if keep and o})
        if len(starts) > MAX_SHIFTS:
            starts = [starts[int(i)] for i in np.linspace(0, len(starts) - 1, MAX_SHIFTS)]
        rows += [[(o - d) % total for o in offsets] for d in starts]
        owner += [b] * len(starts)
    found: list[list[tuple[int, ...]]] = [[] for _ in bases]
    if rows:
        offs = np.asarray(rows, dtype=np.int64)
        ok = np.ones(len(rows), dtype=bool)
        for j, t in enumerate(layout.tensors):
            ok &= uncut_at(t.grid, offs[:, j], S)
        for b, row in zip(np.asarray(owner)[ok].tolist(), offs[ok].tolist(), strict=True):
            found[b].append(tuple(row))
    return found


def candidate_offsets(layout: GroupLayout, movable: list[bool]) -> list[tuple[tuple[int, ...], bool]]:
    """``(offsets, moved)`` per candidate: the tensor shifts of ``layout``, then its tensor moves of
    the ``movable`` tensors ([Note: tensor moves]), each followed by its shifts."""
    if len(layout.buckets) != 1 or layout.world_size == 1:
        return []
    moves = tensor_moves(layout, movable, _uncut)
    shifts = shift_offsets(layout, [tuple(t.offset for t in layout.tensors), *moves])
    out = [(offs, False) for offs in shifts[0]]
    for offs, shifted in zip(moves, shifts[1:], strict=True):
        out += [(offs, True)] + [(s, True) for s in shifted]
    return out


def _uncut(t: TensorPlacement, offset: int, S: int) -> bool:
    return uncut(t.grid, offset, S)


@dataclass(frozen=True, eq=False)
class CandidateTable:
    """A group's candidates (see [Note: candidates by offsets]): row ``i`` puts tensor ``j`` of the
    group at ``offsets[i][j]``; the rows before ``shifts`` are tensor shifts, the rest moves.

    ``fixed_nz[i]`` and ``fixed_vals[i]``: the ranks with a nonzero fixed cost and that cost, padded
    (rank 0, cost 0: never a peak) to one array; ``repeated[i]``: an earlier row has the same offsets
    (``first[i]``: that row, else ``i``); ``fixed_max[i]``: the largest fixed cost. Rotations to try
    are found once per row, when first needed; ``loads[i]``, row ``i``'s elements per rank, once a
    group picks it (identical groups share the table, and pick the same rows).
    """

    layout: GroupLayout
    offsets: list[tuple[int, ...]]
    shifts: int
    fixed_nz: np.ndarray
    fixed_vals: np.ndarray
    counts: np.ndarray
    fixed_max: np.ndarray
    first: np.ndarray
    repeated: np.ndarray
    rotations: dict[int, np.ndarray | None]
    loads: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)

    def fixed(self, i: int) -> np.ndarray:
        """Row ``i``'s fixed cost per rank, as ``_fixed`` computes it for its layout."""
        out = np.zeros(self.layout.world_size)
        out[self.fixed_nz[i, : self.counts[i]]] = self.fixed_vals[i, : self.counts[i]]
        return out

    def rotations_to_try(self, rows: list[int]) -> list[np.ndarray | None]:
        """Per row, what ``rotations_to_try`` gives for its layout and fixed cost."""
        todo = sorted({int(self.first[i]) for i in rows} - self.rotations.keys())
        at = np.asarray(todo, dtype=np.int64)
        told = balanced_rows(self.fixed_vals[at], self.counts[at], self.layout.world_size).tolist()
        unbalanced = [
            i for i, b in zip(todo, told, strict=True) if b == 0 or (b < 0 and not is_balanced(self.fixed(i)))
        ]
        for i in todo:
            self.rotations[i] = None
        if unbalanced:
            clean = clean_rotations_of(self.layout, np.asarray([self.offsets[i] for i in unbalanced]))
            for i, cands in zip(unbalanced, clean, strict=True):
                self.rotations[i] = sample_rotations(cands, int(self.counts[i]))
        return [self.rotations[int(self.first[i])] for i in rows]


def candidate_table(
    layout: GroupLayout, compute: Mapping[str, UnitGrid], costs: Mapping[str, float], movable: list[bool], memo: Memo
) -> CandidateTable:
    """The candidates of ``layout`` (``compute``: its owner-computed tensors' compute grids; ``movable``:
    the tensors a move may take) and their fixed costs."""
    rows: list[tuple[int, ...]] = []
    shifts = 0
    index: dict[tuple[int, ...], int] = {}  # moves and shifts reach some offsets twice
    first = []
    for offs, moved in candidate_offsets(layout, movable):
        first.append(index.setdefault(offs, len(rows)))
        rows.append(offs)
        shifts += not moved
    firsts = np.asarray(first, dtype=np.int64)
    if rows:
        fixed_nz, fixed_vals, counts = fixed_costs(layout, compute, costs, np.asarray(rows, dtype=np.int64), memo)
    else:
        fixed_nz, fixed_vals, counts = np.zeros((0, 0), dtype=np.int64), np.zeros((0, 0)), _EMPTY
    fixed_max = fixed_vals.max(axis=1, initial=0.0)
    repeated = firsts != np.arange(len(rows))
    return CandidateTable(layout, rows, shifts, fixed_nz, fixed_vals, counts, fixed_max, firsts, repeated, {})


def fixed_costs(
    layout: GroupLayout, compute: Mapping[str, UnitGrid], costs: Mapping[str, float], offsets: np.ndarray, memo: Memo
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[Note: candidates by offsets] ``(ranks, costs, how many)`` of the nonzero fixed costs of the
    one-bucket ``layout`` with tensor ``j`` at ``offsets[i, j]``, per row ``i`` (ranks and costs padded
    to one array), as ``_fixed(rank_costs(...))`` computes them: the same float operations per rank.

    ``rank_costs`` adds each tensor's proportional cost to the ranks it touches, in offset order;
    ``_fixed`` then subtracts each owner-computed tensor's cut units, in the same order. A rank strictly
    inside a tensor belongs to it alone (one bucket), so it ends at ``(0 + p) - c``, both fixed by the
    tensor's place in its first segment (found once per place, and zero where the rank is all cut
    units); a rank where tensors start or end may be shared, so its additions, then subtractions, are
    replayed in the tensors' order (``np.add.at`` applies repeated indices one after another)."""
    S, W = layout.buckets[0], layout.world_size
    live = [j for j, t in enumerate(layout.tensors) if t.numel]  # empty tensors add nothing
    C, m = offsets.shape[0], len(live)
    offs = offsets[:, live]
    order = np.argsort(offs, axis=1, kind="stable")  # the tensors of each row in offset order
    lo, rel = np.divmod(np.take_along_axis(offs, order, axis=1), S)
    place = np.asarray(live, dtype=np.int64)[order] * S + rel  # (tensor, place in its first segment)
    places, which = np.unique(place, return_inverse=True)
    which = which.reshape(C, m)
    pieces = [_piece(layout.tensors[p // S], compute, costs, p % S, S, memo) for p in places.tolist()]
    ends = [np.asarray([pc[k] for pc in pieces], dtype=np.float64) for k in range(4)]
    hi = np.asarray([pc[4] for pc in pieces], dtype=np.int64)[which]
    mids = [pc[5] for pc in pieces]
    row = np.repeat(np.arange(C, dtype=np.int64), m).reshape(C, m) * W
    # the first and last rank of each tensor, in each row's order: their additions, then subtractions
    key = np.stack((row + lo, row + lo + hi), axis=2).reshape(-1)
    real = np.stack((np.ones_like(hi, dtype=bool), hi > 0), axis=2).reshape(-1)
    adds = np.stack((ends[0][which], ends[2][which]), axis=2).reshape(-1)[real]
    subs = np.stack((ends[1][which], ends[3][which]), axis=2).reshape(-1)[real]
    edge_keys, slot = np.unique(key[real], return_inverse=True)
    edge_vals = np.zeros(edge_keys.size)
    np.add.at(edge_vals, slot, adds)
    np.subtract.at(edge_vals, slot, subs)
    # the ranks strictly inside a tensor with a nonzero cost
    sizes = np.asarray([r.size for r, _ in mids], dtype=np.int64)
    flat_ranks = np.concatenate([r for r, _ in mids] + [_EMPTY])
    flat_vals = np.concatenate([v for _, v in mids] + [_EMPTY_F])
    n = sizes[which].reshape(-1)
    begin = np.concatenate(([0], np.cumsum(sizes)[:-1]))[which].reshape(-1)
    at = np.repeat(begin - np.concatenate(([0], np.cumsum(n)[:-1])), n) + np.arange(int(n.sum()))
    mid_keys = np.repeat((row + lo).reshape(-1), n) + flat_ranks[at]
    keys = np.concatenate((edge_keys, mid_keys))
    vals = np.concatenate((edge_vals, flat_vals[at]))
    keep = vals != 0
    keys, vals = keys[keep], vals[keep]
    by = np.argsort(keys, kind="stable")
    keys, vals = keys[by], vals[by]
    rows, ranks = np.divmod(keys, W)
    counts = np.bincount(rows, minlength=C)
    col = np.arange(keys.size) - np.concatenate(([0], np.cumsum(counts)[:-1]))[rows]
    fixed_nz = np.zeros((C, int(counts.max(initial=0))), dtype=np.int64)
    fixed_vals = np.zeros(fixed_nz.shape)
    fixed_nz[rows, col] = ranks
    fixed_vals[rows, col] = vals
    return fixed_nz, fixed_vals, counts


def _piece(
    t: TensorPlacement, compute: Mapping[str, UnitGrid], costs: Mapping[str, float], rel: int, S: int, memo: Memo
) -> tuple[float, float, float, float, int, tuple[np.ndarray, np.ndarray]]:
    """Tensor ``t`` starting at ``rel`` of its first segment: ``(proportional, cut cost)`` on its first
    rank, the same on its last, its last rank (from its first) and the ranks between with a nonzero
    fixed cost and that cost (as ``rank_costs`` and ``_fixed`` compute them)."""
    n = t.numel
    hi = (rel + n - 1) // S
    per_elem = costs.get(t.name, float(n)) / n
    if hi == 0:  # one rank: no unit is cut
        return per_elem * n, 0.0, 0.0, 0.0, 0, (_EMPTY, _EMPTY_F)
    grid = compute.get(t.name)
    first, last = per_elem * (S - rel), per_elem * (rel + n - hi * S)
    if grid is not None and every_unit_cut(grid, S) and math.isfinite(per_elem * S):  # all cut: 0 inside
        return first, first, last, last, hi, (_EMPTY, _EMPTY_F)
    cut = None if grid is None else cut_cost_per_rank(grid, rel, S, per_elem, memo)
    mid = np.full(hi - 1, 0.0 + per_elem * S)
    if cut is not None:
        mid -= cut[1:hi]
    inner = np.flatnonzero(mid)
    first_cut, last_cut = (0.0, 0.0) if cut is None else (float(cut[0]), float(cut[hi]))
    return first, first_cut, last, last_cut, hi, (inner + 1, mid[inner])


def clean_rotations_of(layout: GroupLayout, offsets: np.ndarray) -> list[np.ndarray]:
    """[Note: candidates by offsets] ``clean_rotations`` of the one-bucket ``layout`` with tensor ``j``
    at ``offsets[i, j]``, per row ``i``. A tensor covers the boundaries strictly inside it, ``[first,
    last]`` (in segments; empty when it lies in one segment), and in offset order these ranges
    ascend without overlap, so the boundaries no tensor covers are the gaps between them; rotation
    ``k`` is clean when boundary ``W - k`` is in a gap, and ``k = 0`` always is."""
    S, W = layout.buckets[0], layout.world_size
    live = [j for j, t in enumerate(layout.tensors) if t.numel]
    offs = offsets[:, live]
    order = np.argsort(offs, axis=1, kind="stable")
    a = np.take_along_axis(offs, order, axis=1)
    first = a // S + 1
    last = (a + np.asarray([layout.tensors[j].numel for j in live], dtype=np.int64)[order] - 1) // S
    K = offsets.shape[0]
    # gaps [G, E] from the last down, the first one (boundary W) standing for k = 0
    G = np.hstack((np.full((K, 1), W), last[:, ::-1] + 1, np.ones((K, 1), dtype=np.int64)))
    E = np.hstack((np.full((K, 1), W), np.full((K, 1), W - 1), first[:, ::-1] - 1))
    sizes = (E - G + 1).reshape(-1)
    per_row = (E - G + 1).sum(axis=1)
    out: list[np.ndarray] = []
    lo = 0
    while lo < K:  # rows whose rotations fit ROTATION_CHUNK, at a time (at least one)
        hi = lo + max(1, int(np.searchsorted(np.cumsum(per_row[lo:]), ROTATION_CHUNK, side="right")))
        n = sizes[lo * G.shape[1] : hi * G.shape[1]]
        ends = E[lo:hi].reshape(-1)
        step = np.arange(int(n.sum())) - np.repeat(np.concatenate(([0], np.cumsum(n)[:-1])), n)
        k = W - np.repeat(ends, n) + step  # boundary w = end - step, from each gap's end down
        out += np.split(k, np.cumsum(per_row[lo:hi])[:-1])
        lo = hi
    return out


def candidate_peaks(
    rots: list[np.ndarray | None],
    within: np.ndarray,
    fixed_nz: np.ndarray,
    fixed_vals: np.ndarray,
    running: np.ndarray,
    top: float,
) -> tuple[np.ndarray, np.ndarray]:
    """The lowest peak of each candidate ``within`` (rows of ``_table``'s ``fixed_nz`` and
    ``fixed_vals``; ``rots``: its rotations to try, ``None`` or none: rotation 0) and the first
    rotation that reaches it: what :func:`rotation_peak` finds for each, with every candidate's
    rotations in one array (the same sums, so the same floats)."""
    peaks = np.empty(within.size)
    rot = np.zeros(within.size, dtype=np.int64)
    lens = np.asarray([0 if r is None else len(r) for r in rots], dtype=np.int64)
    at0 = within[lens == 0]  # rotation 0 only; the padding adds running <= top
    peaks[lens == 0] = np.maximum((running[fixed_nz[at0]] + fixed_vals[at0]).max(axis=1, initial=top), top)
    searched = np.flatnonzero(lens)
    if searched.size:
        rows = np.repeat(within[searched], lens[searched])
        cands = np.concatenate([rots[s] for s in searched.tolist()]).astype(np.int64)
        pair = np.empty(rows.size)
        step = max(1, PEAK_CHUNK // max(fixed_nz.shape[1], 1))
        for a in range(0, rows.size, step):  # rows of (candidate, rotation), PEAK_CHUNK values at a time
            r, k = rows[a : a + step], cands[a : a + step, None]
            at = np.take(running, fixed_nz[r] + k, mode="wrap")
            at += fixed_vals[r]  # the padding adds running <= top
            pair[a : a + step] = np.maximum(at.max(axis=1, initial=top), top)
        starts = np.concatenate(([0], np.cumsum(lens[searched])[:-1]))
        low = np.minimum.reduceat(pair, starts)
        hits = np.flatnonzero(pair == np.repeat(low, lens[searched]))
        seg = np.searchsorted(starts, hits, side="right") - 1
        firsts = hits[np.unique(seg, return_index=True)[1]]
        peaks[searched] = low
        rot[searched] = cands[firsts]
    return peaks, rot
