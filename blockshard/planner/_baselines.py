"""Baselines: how today's engines would shard a group, computed from shapes alone.

Each baseline answers, for one group and world size ``W``: how many elements are allocated across
all ranks (with the engine's padding), how many each rank holds, and how many *units* (see
:class:`~blockshard.semantics.UnitGrid`) a shard boundary cuts through. blockshard's layouts are
compared against these numbers.

The rules (checked against torch 2.13 FSDP2 and DeepSpeed 0.19.8):

``"fsdp2"``
    ``fully_shard`` places every parameter as ``Shard(0)``: ``torch.chunk(t, W, dim=0)`` gives
    chunks of ``ceil(rows / W)`` rows (the last ranks may get fewer or zero rows) and FSDP2 pads
    every rank's shard to that chunk, so a tensor allocates ``W * chunk * row_numel`` elements.
    A 1-D tensor has ``rows = numel``; a 0-d tensor is one row. Boundaries fall at the multiples of
    ``chunk * row_numel`` inside the tensor.
``"zero3"``
    DeepSpeed ZeRO-3 (``partition_parameters.py``: ``_padding_size`` / ``_partition_param``)
    flat-partitions every parameter on its own into ``ceil(numel / W)`` elements per rank (padded to
    ``W * ceil(numel / W)``); boundaries at the multiples of that. The fetch of a module's
    parameters is one coalesced all-gather, so one collective per group.
``"zero12"``
    DeepSpeed ZeRO-1/2 (``stage_1_and_2.py``) flattens the group's parameters contiguously in order
    (no holes: ``parameter_alignment`` is off by default) and pads the flat buffer with
    ``align_dense_tensors`` to a multiple of ``nccl_start_alignment_factor * W`` where
    ``nccl_start_alignment_factor = 2`` is hard-coded ("4-byte alignment / sizeof(fp16)") -- so the
    padding is to a multiple of ``2 * W`` elements *for every dtype*, not 4 bytes. The buffer is cut
    into ``W`` equal partitions (``get_data_parallel_partitions``); boundaries at the multiples of
    the partition size in the flat buffer.
``"naive"``
    "Pad every tensor to W x unit": every rank holds ``k = ceil(num_units / W)`` consecutive whole
    units of each tensor, in a slot padded to the longest such run (``k * unit_numel`` for plain
    grids; the first/last unit of a ``min_cut`` grid can be longer). Never splits a unit.

A boundary at tensor-relative offset ``x`` splits a unit iff ``not grid.allows_cut(x)``; a unit cut
by several boundaries counts once. Boundaries per tensor form an arithmetic progression, so the
count is O(1) arithmetic per tensor (:func:`progression_split_count`); the flat ZeRO-1/2 boundaries
(``W - 1`` per group) are mapped to tensors with numpy. Nothing loops over elements or units.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from blockshard._errors import PlanError
from blockshard.planner._items import PlanItem
from blockshard.planner._units import ceil_div, check_world_size, round_up, rows_cols
from blockshard.semantics import UnitGrid

__all__ = ["BASELINES", "BaselineResult", "baseline", "combine"]

BASELINES: tuple[str, ...] = ("fsdp2", "zero3", "zero12", "naive")

#: DeepSpeed ZeRO-1/2 ``nccl_start_alignment_factor`` (hard-coded to 2 for every dtype).
DEEPSPEED_NCCL_START_ALIGNMENT_FACTOR = 2


@dataclass(frozen=True)
class BaselineResult:
    """What one engine's sharding costs for a group (or, via :func:`combine`, several groups).

    ``per_rank_numel`` is the most elements any rank holds, padding included (what each rank
    contributes to the all-gather); ``padded_numel`` is what all ranks allocate together;
    ``splits_units`` counts the distinct units a shard boundary falls strictly inside.
    """

    name: str
    world_size: int
    total_numel: int
    padded_numel: int
    per_rank_numel: int
    splits_units: int
    block_respecting: bool
    num_collectives: int
    num_tensors: int
    padding_fraction: float = field(init=False)

    def __post_init__(self) -> None:
        p = self.padded_numel
        object.__setattr__(self, "padding_fraction", (p - self.total_numel) / p if p else 0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "world_size": self.world_size,
            "total_numel": self.total_numel,
            "padded_numel": self.padded_numel,
            "per_rank_numel": self.per_rank_numel,
            "padding_fraction": self.padding_fraction,
            "splits_units": self.splits_units,
            "block_respecting": self.block_respecting,
            "num_collectives": self.num_collectives,
            "num_tensors": self.num_tensors,
        }


# -- input checks -------------------------------------------------------------------------------
def check_name(param: str, value: object, valid: Sequence[str]) -> str:
    if value not in valid:
        raise PlanError(
            f"{param}={value!r} is not a known {param}: it must be one of {list(valid)}; pass one of those names"
        )
    return str(value)


# -- unit arithmetic shared with the owner planner -------------------------------------------------
def shard_step(item: PlanItem, world_size: int, engine: str) -> int:
    """Elements per rank shard (before padding) of one tensor under ``"fsdp2"`` or ``"zero3"``."""
    if engine == "fsdp2":
        rows, row_numel = rows_cols(item.spec.shape)
        return ceil_div(rows, world_size) * row_numel
    return ceil_div(item.numel, world_size)


def unit_index(grid: UnitGrid, x: np.ndarray) -> np.ndarray:
    """Index of the unit (piece between consecutive allowed cuts) holding tensor offset ``x``."""
    n = grid.num_units
    if grid.is_whole:
        return np.zeros_like(x)
    mid = 1 + (x - grid.min_cut) // grid.unit_numel
    return np.where(x < grid.min_cut, 0, np.where(x >= grid.max_cut, n - 1, mid))


def unit_bounds(grid: UnitGrid, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[start, end)`` of units ``idx`` (tensor-relative offsets)."""
    if grid.is_whole:
        return np.zeros_like(idx), np.full_like(idx, grid.numel)
    n = grid.num_units
    start = np.where(idx == 0, 0, grid.min_cut + (idx - 1) * grid.unit_numel)
    end = np.where(idx == n - 1, grid.numel, grid.min_cut + idx * grid.unit_numel)
    return start, end


def split_unit_indices(grid: UnitGrid, x: np.ndarray) -> np.ndarray:
    """Distinct (sorted) indices of the units that boundaries ``x`` (sorted, inside) fall within."""
    if x.size == 0:
        return x
    if grid.is_whole:
        bad = x
    else:
        allowed = (x >= grid.min_cut) & (x <= grid.max_cut) & (x % grid.unit_numel == 0)
        bad = x[~allowed]
    idx = unit_index(grid, bad)  # nondecreasing, since x is sorted
    return idx[np.concatenate(([True], idx[1:] != idx[:-1]))] if idx.size else idx


def progression_split_count(grid: UnitGrid, step: int) -> int:
    """How many units boundaries at the multiples of ``step`` inside the tensor split: O(1) arithmetic.

    Units are ``[0, m)``, ``[m + (j-1)u, m + ju)`` and ``[M, numel)`` (``m, M = min_cut, max_cut``).
    The first is split iff ``step < m``; the last iff a multiple of ``step`` lies in ``(M, numel)``.
    A middle unit (an open interval of length ``u``) holds a multiple of ``step`` if ``step < u``;
    otherwise at most one, and the split middle units are the multiples of ``step`` in ``(m, M)``
    that are not multiples of ``u`` (``m`` and ``M`` are multiples of ``u``).
    """
    numel = grid.numel
    if step <= 0 or numel <= step:
        return 0
    if grid.is_whole:
        return 1
    m, big_m, u = grid.min_cut, grid.max_cut, grid.unit_numel
    count = int(step < m) + int((numel - 1) // step > big_m // step)
    if big_m > m:
        if step < u:
            count += (big_m - m) // u
        else:
            lcm = math.lcm(step, u)
            count += ((big_m - 1) // step - m // step) - ((big_m - 1) // lcm - m // lcm)
    return count


def progression_splits(
    grid: UnitGrid, step: int, cache: dict[tuple[UnitGrid, int], np.ndarray] | None = None
) -> np.ndarray:
    """Split unit indices for boundaries at every multiple of ``step`` strictly inside the tensor."""
    key = (grid, step)
    if cache is not None and key in cache:
        return cache[key]
    numel = grid.numel
    if step <= 0 or numel <= step:
        out = np.zeros(0, dtype=np.int64)
    else:
        out = split_unit_indices(grid, step * np.arange(1, (numel - 1) // step + 1, dtype=np.int64))
    if cache is not None:
        cache[key] = out
    return out


def _naive_slot(grid: UnitGrid, world_size: int) -> int:
    """Longest run of ``k = ceil(num_units / W)`` consecutive units any rank holds.

    Rank ``j`` holds units ``[j*k, (j+1)*k)``; only the first rank (holding the first unit), a middle
    rank (``k`` regular units) and the last occupied rank (holding the last unit) can differ.
    """
    n = grid.num_units
    if n == 0:
        return 0
    k = ceil_div(n, world_size)
    ranks = ceil_div(n, k)

    def cut(i: int) -> int:  # start of unit i; numel past the end
        if i >= n:
            return grid.numel
        return 0 if i == 0 else grid.min_cut + (i - 1) * grid.unit_numel

    return max(cut((j + 1) * k) - cut(j * k) for j in {0, min(1, ranks - 1), ranks - 1})


# -- baselines ------------------------------------------------------------------------------------
def baseline(name: str, items: Sequence[PlanItem], world_size: int) -> BaselineResult:
    """How engine ``name`` (one of :data:`BASELINES`) would shard the group ``items`` on ``world_size`` ranks."""
    name = check_name("baseline", name, BASELINES)
    w = check_world_size(world_size)
    items = list(items)
    total = sum(it.numel for it in items)
    if name in ("fsdp2", "zero3"):
        per_rank = splits = 0
        for it in items:
            step = shard_step(it, w, name)
            per_rank += step
            splits += progression_split_count(it.grid, step)
        padded, respecting = w * per_rank, False
    elif name == "naive":
        per_rank = sum(_naive_slot(it.grid, w) for it in items)
        padded, splits, respecting = w * per_rank, 0, True
    else:  # zero12: one flat buffer padded to a multiple of 2 W, cut into W equal partitions
        padded = round_up(total, DEEPSPEED_NCCL_START_ALIGNMENT_FACTOR * w)
        per_rank = padded // w
        splits, respecting = _flat_splits(items, per_rank, w), False
    return BaselineResult(
        name=name,
        world_size=w,
        total_numel=total,
        padded_numel=padded,
        per_rank_numel=per_rank,
        splits_units=splits,
        block_respecting=respecting,
        num_collectives=1,
        num_tensors=len(items),
    )


def _flat_splits(items: Sequence[PlanItem], part: int, world_size: int) -> int:
    """Units split by boundaries at multiples of ``part`` of the hole-free concatenation of ``items``."""
    if part == 0 or world_size == 1 or not items:
        return 0
    numels = np.array([it.numel for it in items], dtype=np.int64)
    ends = np.cumsum(numels)
    starts = ends - numels
    bounds = part * np.arange(1, world_size, dtype=np.int64)
    t = np.searchsorted(ends, bounds, side="right")
    ok = t < len(items)
    bounds, t = bounds[ok], t[ok]
    inside = bounds > starts[t]
    bounds, t = bounds[inside], t[inside]
    splits = 0
    # Boundaries are sorted, so each tensor's are one contiguous run.
    for ti, lo, hi in _runs(t):
        splits += split_unit_indices(items[ti].grid, bounds[lo:hi] - starts[ti]).size
    return int(splits)


def _runs(t: np.ndarray) -> Iterator[tuple[int, int, int]]:
    if t.size == 0:
        return
    cuts = np.flatnonzero(np.diff(t)) + 1
    los = np.concatenate(([0], cuts))
    his = np.concatenate((cuts, [t.size]))
    for lo, hi in zip(los.tolist(), his.tolist(), strict=True):
        yield int(t[lo]), lo, hi


def combine(results: Sequence[BaselineResult]) -> BaselineResult:
    """Sum several groups' results (same world size); ``per_rank_numel`` adds up across groups."""
    results = list(results)
    if not results:
        raise PlanError("results=[] is empty: combine needs at least one BaselineResult; pass one per group")
    sizes = {r.world_size for r in results}
    if len(sizes) != 1:
        raise PlanError(
            f"results have world_size values {sorted(sizes)}: they must all be equal; "
            "combine only results computed for the same world size"
        )
    names = list(dict.fromkeys(r.name for r in results))
    return BaselineResult(
        name="+".join(names),
        world_size=results[0].world_size,
        total_numel=sum(r.total_numel for r in results),
        padded_numel=sum(r.padded_numel for r in results),
        per_rank_numel=sum(r.per_rank_numel for r in results),
        splits_units=sum(r.splits_units for r in results),
        block_respecting=all(r.block_respecting for r in results),
        num_collectives=sum(r.num_collectives for r in results),
        num_tensors=sum(r.num_tensors for r in results),
    )
