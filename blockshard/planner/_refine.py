"""Owner refinement: lower the busiest rank after the longest-first greedy of cut units.

[Note: owner refinement]
The greedy of ``_owner.py``'s ``_assign`` (longest first onto the least-loaded rank) is within a
unit of the best assignment, and with few unit sizes that unit shows: Mixtral 8x7B at W = 64
(experts of two sizes) ends 1.051 x the bound where 1.041 is reachable. :func:`refine_owners`
then moves one cut unit off the busiest rank to the least-loaded one, or swaps it for a cheaper
unit of one of the ``REFINE_RANKS`` least-loaded ranks, whichever leaves the lower peak of the
two ranks, while that lowers the busiest rank; at most ``MAX_REFINE`` changes, and only a result
with a lower overall peak than the greedy's is kept (else the greedy's owners, and all_to_all
bytes, stay). It is a pure function of its inputs: every rank computes the same owners.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MAX_REFINE", "REFINE_RANKS", "refine_owners"]

#: At most this many moves or swaps refine the owners' greedy.
MAX_REFINE = 256
#: A swap takes a unit from one of this many least-loaded ranks.
REFINE_RANKS = 8


def refine_owners(cost: np.ndarray, owner: np.ndarray, uc: np.ndarray) -> bool:
    """[Note: owner refinement] After the greedy, lower the busiest rank while that helps: move one
    of its cut units to the least-loaded rank, or swap one for a cheaper unit of one of the
    ``REFINE_RANKS`` least-loaded ranks, taking the change that leaves the lowest peak of the two
    ranks; stop when neither lowers it, when the peak is at ``max(mean, costliest unit)`` or after
    ``MAX_REFINE`` changes. Only a state with a lower overall peak than the greedy's is kept (ties
    on the peak keep the greedy's owners and their all_to_all bytes). Updates ``cost`` and ``owner``
    in place; deterministic (first index on ties). Returns whether anything moved."""
    if owner.size == 0 or cost.size < 2:
        return False
    floor = max(float(cost.mean()), float(uc.max())) * (1 + 1e-12)
    held = _Held(owner, cost.size)
    work_cost, work_owner = cost.copy(), owner.copy()
    best_peak, best = float(cost.max()), None
    for _ in range(MAX_REFINE):
        change = _refine_step(work_cost, work_owner, uc, held, floor)
        if change is None:
            break
        if work_cost.max() < best_peak * (1 - 1e-12):
            best_peak, best = float(work_cost.max()), (work_cost.copy(), work_owner.copy())
    if best is None:
        return False
    cost[:], owner[:] = best
    return True


class _Held(dict[int, list[int]]):
    """The cut units of each rank, in the order a rank got them: those it owned after the greedy
    (ascending) listed the first time the rank is asked for, the moves and swaps appended since."""

    def __init__(self, owner: np.ndarray, world_size: int) -> None:
        super().__init__()
        self._units = np.argsort(owner, kind="stable")  # by owner, ascending within one
        self._bounds = np.searchsorted(owner[self._units], np.arange(world_size + 1)).tolist()

    def __missing__(self, rank: int) -> list[int]:
        units: list[int] = self._units[self._bounds[rank] : self._bounds[rank + 1]].tolist()
        self[rank] = units
        return units


def _least_loaded(cost: np.ndarray, k: int) -> np.ndarray:
    """The ranks of the ``k + 1`` smallest costs, ties to the lower rank. (``np.argpartition``'s pick
    among tied costs depends on which sort kernels the CPU runs, AVX2 or AVX-512: the same model got
    another plan on another machine.)"""
    kth = np.partition(cost, k)[k]
    below = np.flatnonzero(cost < kth)
    return np.concatenate([below, np.flatnonzero(cost == kth)[: k + 1 - below.size]])


def _refine_step(
    cost: np.ndarray, owner: np.ndarray, uc: np.ndarray, held: _Held, floor: float
) -> tuple[int, int] | None:
    """One move or swap off the busiest rank (see :func:`refine_owners`); ``None`` when none helps."""
    r = int(np.argmax(cost))
    top = float(cost[r])
    mine = np.asarray(held[r], dtype=np.int64)
    if top <= floor or not mine.size:
        return None
    k = min(REFINE_RANKS, cost.size - 1)
    low = _least_loaded(cost, k)
    low = np.sort(low[low != r])[:k]  # the least-loaded ranks, by rank
    gap = top - cost
    s = int(low[np.argmin(cost[low])])
    best = (top, -1, -1)  # (new peak of the two ranks, unit of r, unit to swap in or -1)
    fits = mine[uc[mine] < gap[s]]
    if fits.size:
        u = int(fits[np.argmax(uc[fits])])
        best = (max(top - uc[u], cost[s] + uc[u]), u, -1)
    others = np.asarray([v for t in low.tolist() for v in held[t]], dtype=np.int64)
    if others.size:
        delta = uc[mine][:, None] - uc[others][None, :]  # what r gives away in each swap
        ok = (delta > 0) & (delta < gap[owner[others]][None, :])
        if ok.any():
            peak = np.where(ok, np.maximum(top - delta, cost[owner[others]][None, :] + delta), np.inf)
            i, j = np.unravel_index(int(np.argmin(peak)), peak.shape)
            if peak[i, j] < best[0]:
                best = (float(peak[i, j]), int(mine[i]), int(others[j]))
    if best[1] < 0:
        return None
    u, v = best[1], best[2]
    t = s if v < 0 else int(owner[v])
    moved = uc[u] - (uc[v] if v >= 0 else 0.0)
    cost[r] -= moved
    cost[t] += moved
    owner[u] = t
    held[r].remove(u)
    held[t].append(u)
    if v >= 0:
        owner[v] = r
        held[t].remove(v)
        held[r].append(v)
    return u, v
