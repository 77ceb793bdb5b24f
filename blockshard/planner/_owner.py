"""Owner plans: who computes each whole unit when the engine keeps element-wise shards.

Stock FSDP2 and DeepSpeed ZeRO-3 shard every tensor on its own into equal element ranges:

``"fsdp2"``  ``torch.chunk(t, W, dim=0)``: rank ``r`` holds elements ``[r*s, (r+1)*s)`` of the
             flattening, ``s = ceil(rows / W) * row_numel`` (the last ranks may hold less or nothing;
             FSDP2's padding is not data and is not counted here).
``"zero3"``  DeepSpeed's flat partition: the same with ``s = ceil(numel / W)``.

A block optimizer must see whole units (see :class:`~blockshard.semantics.UnitGrid`; the units are
the pieces between consecutive allowed cuts, a whole grid is one unit). A unit inside one rank's
shard is computed by that rank. A unit that *straddles* shard boundaries gets one owner: the
gradient pieces move to it (``all_to_all_single``), it runs the optimizer on the whole unit, and the
update pieces move back with the same counts in reverse.

Owners are chosen greedily to balance cost. A tensor's ``item.cost`` is spread over its units in
proportion to their numel; every rank first gets the cost of the units wholly inside its shards
(added in bulk with numpy, never unit by unit), then the straddling units, largest cost first
(ties: tensor order, then unit start), go to the rank with the least cost so far; ties go to the
rank already holding most of that unit, then to the lowest rank. Only straddling units -- at most
``W - 1`` per tensor -- are decided one by one, with a heap over ranks: ``O(U log W)``.
The plan is a pure function of its inputs, so every rank computes the same one.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

import numpy as np

from blockshard._errors import PlanError
from blockshard.planner._baselines import check_name, progression_splits, shard_step, unit_bounds
from blockshard.planner._items import PlanItem
from blockshard.planner._units import check_world_size, rank_overlap
from blockshard.semantics import UnitGrid

__all__ = ["OWNER_ENGINES", "OwnerPlan", "StraddlingUnit", "by_cost", "plan_owners", "unit_rows"]

OWNER_ENGINES: tuple[str, ...] = ("fsdp2", "zero3")


def unit_rows(plan: Any) -> list[tuple[int, int, int, int]]:
    """``(tensor index, start, numel, owner)`` of every cut unit of an owner plan (an
    :class:`OwnerPlan` or the planner's ``OwnerAssignment``: both keep them as four arrays)."""
    arrays = (plan.unit_tensor, plan.unit_start, plan.unit_numel, plan.unit_owner)
    return list(zip(*(a.tolist() for a in arrays), strict=True))


class StraddlingUnit(NamedTuple):
    tensor: str
    start: int  # offset of the unit in the tensor's flattening
    numel: int
    owner: int


@dataclass(frozen=True, eq=False)
class OwnerPlan:
    """Owners of the straddling units and what moving their gradient pieces costs.

    Straddling unit ``i`` is ``unit_numel[i]`` elements starting at ``unit_start[i]`` of tensor
    ``tensor_names[unit_tensor[i]]``, owned by ``unit_owner[i]``; ``tensor_shard_numel[t]`` is the
    shard size ``s`` of tensor ``t`` (rank ``r`` holds ``[r*s, (r+1)*s)``).
    ``send_numel_per_rank[r]`` / ``recv_numel_per_rank[r]``: elements ``r`` sends to / receives from
    *other* ranks in the gradient direction (the update direction swaps them).
    """

    world_size: int
    engine: str
    tensor_names: tuple[str, ...]
    tensor_shard_numel: np.ndarray
    unit_tensor: np.ndarray
    unit_start: np.ndarray
    unit_numel: np.ndarray
    unit_owner: np.ndarray
    cost_per_rank: np.ndarray
    send_numel_per_rank: np.ndarray
    recv_numel_per_rank: np.ndarray

    @property
    def num_straddling(self) -> int:
        return int(self.unit_owner.size)

    @property
    def max_cost_over_mean(self) -> float:
        mean = float(self.cost_per_rank.mean()) if self.world_size else 0.0
        return float(self.cost_per_rank.max()) / mean if mean > 0 else 1.0

    def straddling_units(self) -> list[StraddlingUnit]:
        names = self.tensor_names
        return [StraddlingUnit(names[t], s, n, o) for t, s, n, o in unit_rows(self)]

    def unit_pieces(self, i: int) -> list[tuple[int, int]]:
        """``(rank, elements of straddling unit i that rank holds)`` for every holder, by rank."""
        s = int(self.tensor_shard_numel[self.unit_tensor[i]])
        a = int(self.unit_start[i])
        b = a + int(self.unit_numel[i])
        return [(r, min(b, (r + 1) * s) - max(a, r * s)) for r in range(a // s, (b - 1) // s + 1)]

    def _holder_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per straddling unit: its tensor's shard numel, start, end, and the first and last holder rank."""
        s = self.tensor_shard_numel[self.unit_tensor]
        a = self.unit_start
        b = a + self.unit_numel
        return s, a, b, a // s, (b - 1) // s

    def all_to_all_splits(self, rank: int) -> tuple[list[int], list[int]]:
        """``(input_split_sizes, output_split_sizes)`` of ``rank`` for ``all_to_all_single``, gradient direction.

        ``input[d]``: elements ``rank`` sends to ``d`` (its pieces of straddling units owned by ``d``);
        ``output[d]``: elements ``rank`` receives from ``d`` (``d``'s pieces of units owned by ``rank``).
        Convention: the self entry is 0 -- an owner's own piece is already local and is not copied
        through the collective. For the update direction use ``(output, input)``. Each call is
        ``O(straddling units + W)``; no ``W x W`` matrix is built.
        """
        w = self.world_size
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < w:
            raise PlanError(f"rank={rank!r} is invalid: it must be an integer in [0, {w}); pass a rank of this plan")
        send = np.zeros(w, dtype=np.int64)
        recv = np.zeros(w, dtype=np.int64)
        if self.num_straddling:
            s, a, b, ra, rb = self._holder_arrays()
            own = self.unit_owner
            m = (ra <= rank) & (rank <= rb) & (own != rank)
            piece = np.minimum(b[m], (rank + 1) * s[m]) - np.maximum(a[m], rank * s[m])
            np.add.at(send, own[m], piece)
            m = own == rank
            recv = rank_overlap(a[m], b[m], s[m], w)  # every holder's piece of the units ``rank`` owns
            recv[rank] = 0
        return send.tolist(), recv.tolist()

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "world_size": self.world_size,
            "straddling_units": [u._asdict() for u in self.straddling_units()],
            "cost_per_rank": self.cost_per_rank.tolist(),
            "send_numel_per_rank": self.send_numel_per_rank.tolist(),
            "recv_numel_per_rank": self.recv_numel_per_rank.tolist(),
            "max_cost_over_mean": self.max_cost_over_mean,
        }


#: One tensor's ``(unit starts, unit ends, bulk numel per rank, straddled numel per rank)``.
_TensorLayout: TypeAlias = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _tensor_layout(
    item: PlanItem,
    s: int,
    w: int,
    cache: dict[tuple[UnitGrid, int], _TensorLayout],
    splits_cache: dict[tuple[UnitGrid, int], np.ndarray],
) -> _TensorLayout:
    """``(unit starts, unit ends, bulk numel per rank, straddled numel per rank)`` of one tensor."""
    key = (item.grid, s)
    if key not in cache:
        numel = item.numel
        idx = progression_splits(item.grid, s, splits_cache)
        held = np.zeros(w, dtype=np.int64)
        q, rem = divmod(numel, s)
        held[:q] = s
        if rem:
            held[q] = rem
        if idx.size:
            starts, ends = unit_bounds(item.grid, idx)
            straddled = rank_overlap(starts, ends, s, w)
        else:
            starts = ends = idx
            straddled = np.zeros(w, dtype=np.int64)
        cache[key] = (starts, ends, held - straddled, straddled)
    return cache[key]


def plan_owners(items: Sequence[PlanItem], world_size: int, *, engine: str = "fsdp2") -> OwnerPlan:
    """Owner plan for the group ``items`` under ``engine`` (one of :data:`OWNER_ENGINES`) on ``world_size`` ranks."""
    engine = check_name("engine", engine, OWNER_ENGINES)
    w = check_world_size(world_size)
    items = list(items)
    cost = np.zeros(w, dtype=np.float64)
    straddled_total = np.zeros(w, dtype=np.int64)
    steps = np.zeros(len(items), dtype=np.int64)
    u_t, u_a, u_b, u_c = [], [], [], []
    cache: dict[tuple[UnitGrid, int], _TensorLayout] = {}
    splits_cache: dict[tuple[UnitGrid, int], np.ndarray] = {}
    for t, it in enumerate(items):
        if not (math.isfinite(it.cost) and it.cost >= 0):
            raise PlanError(
                f"tensor {it.name!r}: cost={it.cost!r} is invalid: it must be a finite number >= 0; "
                "fix the block semantics' cost"
            )
        numel = it.numel
        if numel == 0:
            continue
        s = shard_step(it, w, engine)
        steps[t] = s
        starts, ends, bulk, straddled = _tensor_layout(it, s, w, cache, splits_cache)
        density = it.cost / numel
        cost += density * bulk
        if starts.size:
            straddled_total += straddled
            u_t.append(np.full(starts.size, t, dtype=np.int64))
            u_a.append(starts)
            u_b.append(ends)
            u_c.append(density * (ends - starts))
    if u_t:
        ut, ua, ub, uc = (np.concatenate(x) for x in (u_t, u_a, u_b, u_c))
    else:
        ut = ua = ub = np.zeros(0, dtype=np.int64)
        uc = np.zeros(0, dtype=np.float64)
    owner, own_piece = _assign(cost, ut, ua, ub, uc, steps)
    recv = np.zeros(w, dtype=np.int64)
    np.add.at(recv, owner, (ub - ua) - own_piece)
    kept = np.zeros(w, dtype=np.int64)
    np.add.at(kept, owner, own_piece)
    return OwnerPlan(
        world_size=w,
        engine=engine,
        tensor_names=tuple(it.name for it in items),
        tensor_shard_numel=steps,
        unit_tensor=ut,
        unit_start=ua,
        unit_numel=ub - ua,
        unit_owner=owner,
        cost_per_rank=cost,
        send_numel_per_rank=straddled_total - kept,
        recv_numel_per_rank=recv,
    )


def _assign(
    cost: np.ndarray,
    ut: np.ndarray,
    ua: np.ndarray,
    ub: np.ndarray,
    uc: np.ndarray,
    steps: np.ndarray,
    order: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy owners of straddling units (updates ``cost`` in place); returns owners and their own pieces.
    ``order``: the units by the greedy's order, when the caller has it (else sorted here)."""
    n = ut.size
    owner = np.zeros(n, dtype=np.int64)
    own_piece = np.zeros(n, dtype=np.int64)
    if n == 0:
        return owner, own_piece
    if order is None:
        order = np.lexsort((ua, ut, -uc))  # largest cost first; ties by tensor order, then unit start
    a_o, b_o, s_o = ua[order], ub[order], steps[ut][order]
    ra_o, rb_o = a_o // s_o, (b_o - 1) // s_o
    first = np.minimum(b_o, (ra_o + 1) * s_o) - a_o  # the first holder's piece
    last = b_o - rb_o * s_o  # the last holder's piece
    c_o = uc[order]
    costs = cost.tolist()
    if _costs_rise(cost, c_o):
        wants = (first < s_o) | ((last > first) << 1)  # see _greedy_by_level
        owners = _greedy_by_level(costs, ra_o.tolist(), rb_o.tolist(), wants.tolist(), c_o.astype(np.float64))
    else:
        units = (ra_o.tolist(), rb_o.tolist(), first.tolist(), last.tolist(), c_o.tolist(), s_o.tolist())
        owners = _greedy(costs, *units)
    cost[:] = costs
    owner[order] = owners
    own_piece[:] = np.maximum(0, np.minimum(ub, (owner + 1) * steps[ut]) - np.maximum(ua, owner * steps[ut]))
    return owner, own_piece


def by_cost(uc: np.ndarray) -> np.ndarray:
    """The units largest cost first, ties in index order: :func:`_assign`'s order where every unit is
    its own tensor (the planner's cut units), without its tie-break on the start."""
    return np.argsort(-uc, kind="stable")


def _costs_rise(cost: np.ndarray, uc: np.ndarray) -> bool:
    """Whether adding any unit's cost to any rank's cost on the way strictly raises it (finite costs,
    each unit's above twice the float spacing at a bound of every rank's final cost): then
    :func:`_greedy_by_level` makes the same choices as :func:`_greedy`."""
    if not (np.isfinite(cost).all() and np.isfinite(uc).all()):
        return False
    bound = float(np.abs(cost).max(initial=0.0)) + float(uc.sum())
    return math.isfinite(bound) and float(uc.min()) > 2 * float(np.spacing(bound))


def _greedy(
    costs: list[float],
    ras: list[int],
    rbs: list[int],
    firsts: list[int],
    lasts: list[int],
    ucs: list[float],
    ss: list[int],
) -> list[int]:
    """The owner of each unit in turn (``costs`` updated): its cost goes to the least-loaded rank (ties:
    the holder with the largest piece, then the lowest rank), with a heap over ranks."""
    heap = [(c, r) for r, c in enumerate(costs)]
    heapq.heapify(heap)
    owners: list[int] = []
    push, replace = heapq.heappush, heapq.heapreplace
    for ra, rb, p_first, p_last, c, s in zip(ras, rbs, firsts, lasts, ucs, ss, strict=True):
        while heap[0][0] != costs[heap[0][1]]:  # drop stale entries
            heapq.heappop(heap)
        cmin, rmin = heap[0]
        # Among the ranks the unit straddles at the lowest cost, the one holding most of it (the
        # lowest such rank); else the lowest-cost rank. The first and last rank hold a part of
        # their segment, every rank between them the whole segment s.
        o, best = rmin, -1
        if costs[ra] == cmin:
            o, best = ra, p_first
        if best < s and rb - ra > 1:
            try:  # list.index: a scan in C
                o, best = costs.index(cmin, ra + 1, rb), s
            except ValueError:
                pass
        if rb > ra and costs[rb] == cmin and p_last > best:
            o = rb
        costs[o] += c
        if o == rmin:  # its entry is the heap's top: one sift instead of a push and a later pop
            replace(heap, (costs[o], o))
        else:
            push(heap, (costs[o], o))
        owners.append(o)
    return owners


def _greedy_by_level(
    costs: list[float], ras: list[int], rbs: list[int], wants: list[int], ucs: np.ndarray
) -> list[int]:
    """:func:`_greedy`'s owners, a level at a time, where every added cost strictly raises a rank's
    (:func:`_costs_rise`). While ``m`` ranks tie at the lowest cost, the next ``m`` units each go to
    one of them (a rank that got one has risen above the tie): a level is its tied ranks as a
    bytearray, a unit's choice a few lookups and scans in C, and the ranks are kept by cost (a
    heap of the distinct costs), not one heap entry per rank. The units come largest cost first,
    so a level's units are a few runs of one cost (``ucs``), and the ranks that got a run's units
    all rise to one cost, the level's plus the run's: they move to that level together.

    A unit's pieces enter :func:`_greedy`'s choice only by comparison (every piece is at most the
    segment ``s``): bit 1 of ``wants`` is ``first piece < s`` (a rank between the first and last
    beats the first), bit 2 ``last piece > first piece`` (the last beats the first)."""
    W = len(costs)
    levels: dict[float, list[int]] = {}  # cost -> the ranks at it
    for r, c in enumerate(costs):
        levels.setdefault(c, []).append(r)
    heap = list(levels)
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    owners: list[int] = []
    n = ucs.size
    run_ends = (np.flatnonzero(ucs[1:] != ucs[:-1]) + 1).tolist() + [n]
    risen = np.asarray(costs, dtype=np.float64)  # every rank's cost as units arrive
    i = run = 0
    while i < n:
        low = pop(heap)
        tied = levels.pop(low)
        start, e = i, min(n, i + len(tied))
        level = tied if len(tied) == 1 else _tied_level(tied, W, ras[i:e], rbs[i:e], wants[i:e])
        while i < e:  # a run of units of one cost: their ranks rise to one cost
            while run_ends[run] <= i:
                run += 1
            b = min(e, run_ends[run])
            c = low + float(ucs[i])
            ranks = level[i - start : b - start]
            risen[ranks] = c
            at = levels.get(c)
            if at is None:
                levels[c] = ranks
                push(heap, c)
            else:
                at += ranks
            i = b
        owners += level
    costs[:] = risen.tolist()
    return owners


def _tied_level(tied: list[int], W: int, ras: list[int], rbs: list[int], wants: list[int]) -> list[int]:
    """The ranks of ``tied`` (several, at the lowest cost) that the next units take, one each (see
    :func:`_greedy_by_level`): a held rank where :func:`_greedy` would pick it, else the lowest."""
    tied.sort()
    left = bytearray(W)  # left[r]: rank r ties at the lowest cost and has no unit of this level yet
    for r in tied:
        left[r] = 1
    lowest = tied[0]
    level: list[int] = []
    append, find = level.append, left.find
    for ra, rb, want in zip(ras, rbs, wants, strict=True):
        if left[ra]:  # the first holder, unless a middle one (whole segment) or the last holds more
            o = ra
            m = find(1, ra + 1, rb) if want & 1 and rb - ra > 1 else -1
            if m >= 0:
                o = m
            elif want & 2 and rb > ra and left[rb]:
                o = rb
        else:  # the first middle holder, else the last, else the lowest rank
            o = find(1, ra + 1, rb) if rb - ra > 1 else -1
            if o < 0:
                if rb > ra and left[rb]:
                    o = rb
                else:
                    o = lowest = find(1, lowest)
        left[o] = 0
        append(o)
    return level
