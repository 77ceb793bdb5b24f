"""Who computes what: owners of cut compute units across all groups, and per-rank tallies.

[Note: owners across groups]
Under the ``owner`` policy a rank boundary may fall inside a compute unit (a Muon matrix, an
expert). A compute unit that lies inside one rank's segment is computed there; a **cut** one
gets one owner rank. Groups are taken in ``fully_shard`` order; each is rotated by whole
segments (see [Note: rotation] in ``_balance.py``; a group with owner-computed tensors may also be
re-based at another tensor, see [Note: shifts], or have a costly whole-placed tensor moved in its
order, see [Note: tensor moves] in ``_moves.py``) against the cost fixed so far: what its ranks
compute themselves. Then every cut unit of the model, largest cost first, goes to the
least-loaded rank (ties: the holder with the largest piece, then the lowest rank) — the greedy
of ``_owner.py``'s :func:`_assign`, run once over all groups, then refined by moves and swaps off
the busiest rank ([Note: owner refinement] in ``_refine.py``). Costs are the semantics' (Newton-Schulz
FLOPs for matrices, elements otherwise) split over a tensor's units in proportion to their
elements. The result is a pure function of the inputs: every rank computes the same owners,
and :meth:`OwnerAssignment.owner_hash` is checked like a layout hash.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np

from blockshard.planner._balance import rank_costs, rotate, rotation_peak, rotations_to_try
from blockshard.planner._candidates import (
    CandidateTable,
    candidate_peaks,
    candidate_table,
    shift_offsets,
    with_offsets,
)
from blockshard.planner._cuts import cut_cost_per_rank, straddling_units
from blockshard.planner._layout import GroupLayout, TensorPlacement
from blockshard.planner._owner import _assign, by_cost, unit_rows
from blockshard.planner._refine import refine_owners
from blockshard.planner._units import Memo, layout_hash, rank_overlap
from blockshard.semantics import UnitGrid

__all__ = ["ComputeTally", "OwnerAssignment", "OwnerPlanBuilder", "straddling_units"]

#: Shifts are tried for a group where one rank's fixed cost (what it computes itself) exceeds this
#: fraction of the group's mean cost per rank: below it, repeating the layout costs little.
SHIFT_WORTH = 0.05

#: ``(proportional cost, fixed cost, loads in bytes, largest unit cost)`` of a group (``_geometry``).
_Geometry: TypeAlias = tuple[np.ndarray, np.ndarray, np.ndarray, float]
#: ``(loaded ranks, rotations to try, largest fixed cost)`` of a group as laid out (``_placed``).
_Search: TypeAlias = tuple[np.ndarray, np.ndarray | None, float]
#: A tensor's cut units: ``(kind, tensor, starts, ends, offset, S, density, itemsize)``.
_CutUnits: TypeAlias = tuple[str, str, np.ndarray, np.ndarray, int, int, float, int]


def tensor_shifts(layout: GroupLayout, memo: Memo | None = None) -> list[GroupLayout]:
    """[Note: shifts] ``layout`` re-based so that another tensor starts the gathered buffer.

    Rotating by whole segments (``_balance.py``) needs a segment boundary outside every tensor,
    which an owner-policy layout rarely has: its fine tensors straddle nearly every boundary, so
    identical blocks would keep their whole-placed units on the same ranks. Starting the circular
    order of a one-bucket layout at tensor ``j`` (every offset minus ``offset_j``, modulo ``W * S``)
    keeps the tensors contiguous and the holes between tensors; it is kept when every rank boundary
    still falls on an allowed cut of every tensor's grid. At most ``MAX_SHIFTS`` (``_candidates.py``)
    starts (evenly spaced) are tried; the result depends only on the layout.
    """
    if len(layout.buckets) != 1 or layout.world_size == 1:
        return []
    key = ("shifts", layout.buckets, tuple((t.offset, t.grid) for t in layout.tensors))
    found: list[tuple[int, ...]] | None = memo.get(key) if memo is not None else None
    if found is None:
        found = shift_offsets(layout, [tuple(t.offset for t in layout.tensors)])[0]
        if memo is not None:
            memo[key] = found
    return [with_offsets(layout, offs) for offs in found]


def _loads(layout: GroupLayout) -> np.ndarray:
    """Real elements per rank (float64), as ``GroupLayout.rank_loads``: the first and last piece of
    each tensor, and whole segments between them through a difference array."""
    ts = layout.tensors
    W = layout.world_size
    a = np.fromiter((t.offset for t in ts), dtype=np.int64, count=len(ts))
    b = a + np.fromiter((t.numel for t in ts), dtype=np.int64, count=len(ts))
    s = np.fromiter((layout.buckets[t.bucket] for t in ts), dtype=np.int64, count=len(ts))
    keep = b > a
    a, b, s = a[keep], b[keep], s[keep]
    ra, rb = a // s, (b - 1) // s
    out = np.bincount(ra, weights=np.minimum(b, (ra + 1) * s) - a, minlength=W + 1)
    multi = rb > ra
    out += np.bincount(rb[multi], weights=b[multi] - rb[multi] * s[multi], minlength=W + 1)
    diff = np.bincount(ra[multi] + 1, weights=s[multi], minlength=W + 1)
    diff -= np.bincount(rb[multi], weights=s[multi], minlength=W + 1)
    return (out + np.cumsum(diff))[:W]


@dataclass(frozen=True, eq=False)
class OwnerAssignment:
    """The owner of every cut compute unit of a model: unit ``i`` is ``unit_numel[i]`` elements
    from ``unit_start[i]`` of tensor ``tensor_names[unit_tensor[i]]``, computed by ``unit_owner[i]``.
    Compute units not listed lie inside one rank's segment and are computed there."""

    world_size: int
    tensor_names: tuple[str, ...]
    unit_tensor: np.ndarray
    unit_start: np.ndarray
    unit_numel: np.ndarray
    unit_owner: np.ndarray

    @property
    def num_units(self) -> int:
        return int(self.unit_owner.size)

    def to_json(self) -> dict[str, Any]:
        names = self.tensor_names
        return {
            "world_size": self.world_size,
            "units": [[names[t], s, n, o] for t, s, n, o in unit_rows(self)],
        }

    def owner_hash(self) -> str:
        """A stable hash of the assignment (every rank must compute the same one)."""
        return layout_hash(self.to_json())


@dataclass(frozen=True, eq=False)
class ComputeTally:
    """Per-rank optimizer facts of some groups (a group kind, or the model).

    ``cost``: optimizer compute per rank; ``state_bytes``: bytes of the parameters whose step the
    rank computes (one optimizer-state tensor of the parameter dtype, e.g. Muon's momentum; scale
    by your optimizer's state count); ``all_to_all_bytes``: bytes a rank receives per step in the
    owner all_to_alls (gradient pieces in, new values back); ``largest_unit_cost``: the costliest
    compute unit; ``modeled_cost_bytes``: [Note: policy cost model] per rank per step.
    """

    cost: np.ndarray
    state_bytes: np.ndarray
    all_to_all_bytes: np.ndarray
    largest_unit_cost: float
    modeled_cost_bytes: float
    owner_tensors: int

    @property
    def cost_lower_bound(self) -> float:
        """``max(mean, largest compute unit)``: no owner plan gets the busiest rank below it."""
        return max(float(self.cost.mean()) if self.cost.size else 0.0, self.largest_unit_cost)

    @property
    def max_cost_over_lower_bound(self) -> float:
        lb = self.cost_lower_bound
        return float(self.cost.max()) / lb if lb > 0 else 1.0

    def to_json(self) -> dict[str, Any]:
        return {
            "owner_tensors": self.owner_tensors,
            "all_to_all_bytes_per_rank_max": int(self.all_to_all_bytes.max(initial=0)),
            "all_to_all_bytes_per_rank_mean": float(self.all_to_all_bytes.mean()) if self.cost.size else 0.0,
            "optimizer_state_bytes_per_rank_max": int(self.state_bytes.max(initial=0)),
            "optimizer_state_bytes_per_rank_mean": float(self.state_bytes.mean()) if self.cost.size else 0.0,
            "optimizer_cost_per_rank_max": float(self.cost.max(initial=0.0)),
            "optimizer_cost_lower_bound": self.cost_lower_bound,
            "optimizer_cost_max_over_lower_bound": self.max_cost_over_lower_bound,
            "modeled_cost_bytes_per_rank": self.modeled_cost_bytes,
        }


@dataclass
class _Kind:
    cost: np.ndarray
    state: np.ndarray
    largest: float = 0.0
    modeled: float = 0.0
    owner_tensors: int = 0


@dataclass
class OwnerPlanBuilder:
    """Collects groups in order (rotating each), then assigns every cut unit an owner (:meth:`finish`)."""

    world_size: int
    memo: Memo
    kinds: dict[str, _Kind] = field(default_factory=dict)
    units: list[_CutUnits] = field(default_factory=list)
    total: float = 0.0  # cost of the groups added so far, whole and cut units alike

    def add_group(
        self,
        layout: GroupLayout,
        kind: str,
        compute: Mapping[str, UnitGrid],
        costs: Mapping[str, float],
        running: np.ndarray,
        modeled: float,
        unrotated: np.ndarray,
    ) -> GroupLayout:
        """Rotate ``layout`` (whose tensors in ``compute`` are owner-computed on those compute grids)
        against ``running``, add what its ranks compute themselves to ``running`` (and its proportional
        cost to ``unrotated``, for the report); return it rotated."""
        W = self.world_size
        (proportional, base, loads, largest), (nz, rotations, top) = self._placed(layout, compute, costs)
        unrotated += proportional
        self.total += self._total(layout, costs)
        k = rotation_peak(nz, base[nz], rotations, running)[0]  # best_rotation, its rotations found once
        if compute and top > SHIFT_WORTH * self._total(layout, costs) / W:
            layout, base, loads, k = self._best_shift(layout, compute, costs, running, (base, loads, k))
        nz = np.flatnonzero(base != 0)
        running[(nz + k) % W] += base[nz]  # exactly as balance() does, so whole plans match the engine's
        layout = rotate(layout, k)
        self._collect(layout, compute, costs, kind)
        tally = self.kinds.setdefault(kind, _Kind(np.zeros(W), np.zeros(W)))
        tally.cost += np.roll(base, k)
        tally.modeled += modeled
        tally.owner_tensors += len(compute)
        tally.state += np.roll(loads, k)
        tally.largest = max(tally.largest, largest)
        return layout

    def _geometry(self, layout: GroupLayout, compute: Mapping[str, UnitGrid], costs: Mapping[str, float]) -> _Geometry:
        """``(proportional cost, fixed cost, loads in bytes, largest unit cost)``; identical blocks share one."""
        return self._placed(layout, compute, costs)[0]

    def _placed(
        self, layout: GroupLayout, compute: Mapping[str, UnitGrid], costs: Mapping[str, float]
    ) -> tuple[_Geometry, _Search]:
        """:meth:`_geometry`, and the loaded ranks, rotations to try and largest fixed cost of the
        group as laid out (what ``best_rotation`` finds of it); identical blocks share them."""
        key = (
            "group",
            layout.itemsize,
            layout.buckets,
            tuple((t.offset, t.bucket, t.grid, costs.get(t.name), compute.get(t.name)) for t in layout.tensors),
        )
        hit: tuple[_Geometry, _Search] | None = self.memo.get(key)
        if hit is None:
            proportional = rank_costs(layout, costs)
            base = self._fixed(layout, compute, costs, proportional.copy())
            loads = _loads(layout) * layout.itemsize
            nz = np.flatnonzero(base != 0)
            search = (nz, rotations_to_try(layout, base, nz), float(base.max()))
            hit = self.memo[key] = ((proportional, base, loads, self._largest(layout, compute, costs)), search)
        return hit

    def _total(self, layout: GroupLayout, costs: Mapping[str, float]) -> float:
        return sum(costs.get(t.name, float(t.numel)) for t in layout.tensors)

    def _best_shift(
        self,
        layout: GroupLayout,
        compute: Mapping[str, UnitGrid],
        costs: Mapping[str, float],
        running: np.ndarray,
        current: tuple[np.ndarray, np.ndarray, int],
    ) -> tuple[GroupLayout, np.ndarray, np.ndarray, int]:
        """Among ``layout``, its tensor shifts (see [Note: shifts]) and its tensor moves ([Note: tensor
        moves]), the one whose fixed cost, at its best rotation, leaves the lowest peak on ``running``
        (the first on ties: ``layout`` itself, then the shifts, then the moves). Moves are compared
        only when the best of the others leaves a peak above the mean cost per rank of the groups so
        far (whole and cut units): below it, the owners of cut units level the ranks around the
        fixed costs, and a move would only change which units are cut."""
        base, loads, k = current
        nz = np.flatnonzero(base != 0)
        best: tuple[float, GroupLayout, np.ndarray, np.ndarray, int] = (
            rotation_peak(nz, base[nz], None if k == 0 else np.asarray([k]), running)[1],
            layout,
            base,
            loads,
            k,
        )
        table = self._table(layout, compute, costs)
        if table.offsets:
            fixed_nz, fixed_vals = table.fixed_nz, table.fixed_vals
            top = running.max(initial=0.0)
            # a candidate's peak at any rotation is at least its costliest rank's cost on the least
            # loaded rank; one whose bound reaches the lowest peak so far can never be picked (a pick
            # must be strictly lower, the first on ties), so its rotations are not searched
            bound = np.maximum(table.fixed_max + running.min(initial=0.0), top)
            bound[table.repeated] = np.inf  # an earlier candidate has the same peak
            ks = np.zeros(len(table.offsets), dtype=np.int64)

            def first_lowest(lo: int, hi: int, ceiling: float) -> tuple[int, float]:
                """The first of candidates ``[lo, hi)`` with the lowest peak, if below ``ceiling``."""
                within = np.flatnonzero(bound[lo:hi] < ceiling) + lo
                if not within.size:
                    return -1, ceiling
                rots = table.rotations_to_try(within.tolist())  # shared by identical groups: found once
                peaks, rot = candidate_peaks(rots, within, fixed_nz, fixed_vals, running, top)
                peaks[peaks >= ceiling] = np.inf
                j = int(np.argmin(peaks))  # the first on ties
                if not peaks[j] < ceiling:
                    return -1, ceiling
                ks[within[j]] = rot[j]
                return int(within[j]), float(peaks[j])

            pick, low = first_lowest(0, table.shifts, best[0])
            # a move only where the peak would pass the mean so far: below it, the owners level around it
            if len(table.offsets) > table.shifts and low > self.total / self.world_size:
                moved, low = first_lowest(table.shifts, len(table.offsets), low)
                pick = moved if moved >= 0 else pick
            if pick >= 0:
                picked = with_offsets(layout, table.offsets[pick])  # this group's names
                if pick not in table.loads:
                    table.loads[pick] = _loads(picked)
                best = (low, picked, table.fixed(pick), table.loads[pick] * picked.itemsize, int(ks[pick]))
        return best[1:]

    def _table(
        self, layout: GroupLayout, compute: Mapping[str, UnitGrid], costs: Mapping[str, float]
    ) -> CandidateTable:
        """The candidates of ``layout`` ([Note: candidates by offsets] in ``_candidates.py``): its tensor
        shifts, then its moves of whole-placed tensors costlier than ``SHIFT_WORTH`` x its mean cost
        per rank; identical groups share one table."""
        key = (
            "table",
            layout.buckets,
            tuple((t.offset, t.grid, costs.get(t.name), compute.get(t.name)) for t in layout.tensors),
        )
        hit: CandidateTable | None = self.memo.get(key)
        if hit is None:
            worth = SHIFT_WORTH * self._total(layout, costs) / self.world_size
            movable = [t.name not in compute and costs.get(t.name, 0.0) > worth for t in layout.tensors]
            hit = self.memo[key] = candidate_table(layout, compute, costs, movable, self.memo)
        return hit

    @staticmethod
    def _largest(layout: GroupLayout, compute: Mapping[str, UnitGrid], costs: Mapping[str, float]) -> float:
        """Cost of the costliest compute unit of the group."""
        out = 0.0
        for t in layout.tensors:
            if t.numel:
                grid = compute.get(t.name, t.grid)
                out = max(out, costs.get(t.name, float(t.numel)) * grid.largest_unit / t.numel)
        return out

    def _cut(
        self, layout: GroupLayout, compute: Mapping[str, UnitGrid], costs: Mapping[str, float]
    ) -> Iterator[tuple[TensorPlacement, np.ndarray, np.ndarray, int, float]]:
        """``(tensor, starts, ends, S, density)`` of every owner-computed tensor with cut compute units."""
        for t in layout.tensors:
            grid = compute.get(t.name)
            if grid is None or not t.numel:
                continue
            S = layout.buckets[t.bucket]
            starts, ends = straddling_units(grid, t.offset, S, self.memo)
            if starts.size:
                yield t, starts, ends, S, costs.get(t.name, float(t.numel)) / t.numel

    def _fixed(
        self, layout: GroupLayout, compute: Mapping[str, UnitGrid], costs: Mapping[str, float], base: np.ndarray
    ) -> np.ndarray:
        """Cost per rank of what each rank computes itself (``base``, the proportional cost, less the cut units)."""
        for t in layout.tensors:  # the tensors of _cut, per tensor: the plans' float sums
            grid = compute.get(t.name)
            if grid is None or not t.numel:
                continue
            S = layout.buckets[t.bucket]
            cut = cut_cost_per_rank(grid, t.offset, S, costs.get(t.name, float(t.numel)) / t.numel, self.memo)
            if cut is None:  # _cut's straddling_units finds none
                continue
            lo = t.offset // S
            base[lo : lo + cut.size] -= cut
        return base

    def _collect(
        self, layout: GroupLayout, compute: Mapping[str, UnitGrid], costs: Mapping[str, float], kind: str
    ) -> None:
        for t, starts, ends, S, density in self._cut(layout, compute, costs):
            self.units.append((kind, t.name, starts, ends, t.offset, S, density, layout.itemsize))

    def _columns(self, units: list[_CutUnits]) -> tuple[list[np.ndarray], np.ndarray]:
        """Per cut unit: tensor index, start, end (tensor), start, end (bucket), S, cost, itemsize; and
        its kind (an index into ``self.kinds``; -1 for a kind no group added: the engine's
        ``add_fixed`` collects units it does not tally). A tensor's fields are repeated over its units."""
        if not units:
            return [np.zeros(0, dtype=np.int64)] * 8, np.zeros(0, dtype=np.int64)
        names = {n: i for i, n in enumerate(dict.fromkeys(u[1] for u in self.units))}
        kinds = {kd: i for i, kd in enumerate(self.kinds)}
        us, ue = np.concatenate([u[2] for u in units]), np.concatenate([u[3] for u in units])
        sizes = [u[2].size for u in units]
        kind, name, offset, S, density, itemsize = (
            np.repeat(np.asarray(col), sizes)
            for col in zip(
                *((kinds.get(kd, -1), names[n], o, seg, d, b) for kd, n, _, _, o, seg, d, b in units), strict=True
            )
        )
        return [name, us, ue, offset + us, offset + ue, S, density * (ue - us), itemsize], kind

    def finish(self, running: np.ndarray) -> tuple[OwnerAssignment, dict[str, ComputeTally]]:
        """Owners of every cut unit (adds their cost to ``running``); per-kind tallies."""
        W = self.world_size
        names = tuple(dict.fromkeys(u[1] for u in self.units))
        (ut, us, ue, ua, ub, steps, uc, item), kind_of = self._columns(self.units)
        owner, own_piece = _assign(running, np.arange(ut.size), ua, ub, uc.astype(np.float64), steps, by_cost(uc))
        if refine_owners(running, owner, uc.astype(np.float64)):
            own_piece = np.maximum(0, np.minimum(ub, (owner + 1) * steps) - np.maximum(ua, owner * steps))
        kinds = {
            kd: self._tally(kd, kind_of == i, owner, own_piece, ua, ub, steps, uc, item)
            for i, kd in enumerate(self.kinds)
        }
        return OwnerAssignment(W, names, ut, us, ue - us, owner), kinds

    def _tally(
        self,
        kind: str,
        m: np.ndarray,
        owner: np.ndarray,
        own_piece: np.ndarray,
        ua: np.ndarray,
        ub: np.ndarray,
        steps: np.ndarray,
        uc: np.ndarray,
        item: np.ndarray,
    ) -> ComputeTally:
        """The tally of ``kind``, whose cut units are those where ``m``."""
        W, t = self.world_size, self.kinds[kind]
        a2a = np.zeros(W)
        if m.any():
            numel = (ub - ua)[m]
            size = item[m].astype(np.float64)
            held = np.zeros(W)
            low, high = item[m].min(), item[m].max()
            for b in [low] if low == high else np.unique(item[m]):  # a group's pieces in its own itemsize
                sel = m & (item == b)
                held += b * rank_overlap(ua[sel], ub[sel], steps[sel], W)
            kept = np.zeros(W)
            np.add.at(kept, owner[m], own_piece[m] * size)
            recv = np.zeros(W)
            np.add.at(recv, owner[m], (numel - own_piece[m]) * size)
            a2a = (held - kept) + recv  # update pieces come back to the holders; gradient pieces go in
            np.add.at(t.cost, owner[m], uc[m])
            t.state += recv - (held - kept)
        return ComputeTally(t.cost, t.state, a2a, t.largest, t.modeled, t.owner_tensors)
