"""Quantized bytes per rank and gathered per step: the engine's frozen quantized buffer sets, predicted from shapes.

[Note: planned quantized bytes]
``fully_shard`` gives the frozen quantized weights of each group a buffer set of their own
([Note: frozen quantized buffers] in ``runtime/quantized/_frozen.py``): their units concatenated in the group's
order, rank ``r``'s cut at the unit boundary nearest to ``r * total / W`` (ties to the lower), every
segment padded to the largest, ``S`` bytes rounded up to the alignment. :func:`plan_quantized_group`
computes the same cuts from each tensor's :class:`~blockshard.semantics.QuantizedStorage` without
listing units: inside a tensor every unit but the last has the same bytes, so the first boundary at
or past a cut is found by one division (the engine searches every unit's bytes: a 405B model has
billions). ``tests/quantized/test_fast_plan_bytes.py`` checks the bytes equal the engine's
``blockshard.quantized_stats`` and each rank's held bytes exactly.
Per step, a group's quantized weights are gathered in the forward and, where the group reshards
after forward (FSDP2's default for every group but the root), again before the backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from blockshard._arith import ceil_div
from blockshard.planner._units import Memo
from blockshard.semantics._storage import QuantizedStorage

__all__ = ["BF16_BYTES", "QuantizedGroupBytes", "plan_quantized_group", "quantized_totals"]

BF16_BYTES = 2  # a bf16 gather of the same weights moves 2 bytes per value


@dataclass(frozen=True)
class QuantizedGroupBytes:
    """One group's quantized weights on ``world_size`` ranks (see [Note: planned quantized bytes]).

    ``segment_bytes`` is what every rank keeps (``quantized_stats(...).local_bytes``), ``rank_bytes``
    the payload and scales each rank holds of it (the rest is padding), ``gathered_bytes`` one
    all-gather's output on every rank (``quantized_stats(...).gathered_bytes``).
    """

    group: str
    world_size: int
    tensors: tuple[str, ...]
    numel: int  # quantized values
    payload_bytes: int
    total_bytes: int  # payload and scales of every tensor, no padding
    segment_bytes: int
    rank_bytes: tuple[int, ...]
    constant_bytes: int  # replicated on every rank: code tables (once per group), per-tensor offsets
    gathers_per_step: int  # 2 where the group reshards after forward, 1 for the root

    @property
    def scale_bytes(self) -> int:
        return self.total_bytes - self.payload_bytes

    @property
    def gathered_bytes(self) -> int:
        return self.world_size * self.segment_bytes

    @property
    def bf16_bytes(self) -> int:
        return BF16_BYTES * self.numel

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "tensors": list(self.tensors),
            "numel": self.numel,
            "payload_bytes": self.payload_bytes,
            "scale_bytes": self.scale_bytes,
            "total_bytes": self.total_bytes,
            "segment_bytes": self.segment_bytes,
            "rank_bytes": list(self.rank_bytes),
            "constant_bytes": self.constant_bytes,
            "gathered_bytes": self.gathered_bytes,
            "gathers_per_step": self.gathers_per_step,
            "bf16_bytes": self.bf16_bytes,
        }


def _cuts(storages: Sequence[QuantizedStorage], world_size: int) -> np.ndarray:
    """The byte where every rank's units start (and the end), as the engine's ``plan_quantized`` cuts
    them (same float comparisons, ties to the lower boundary), for all ranks at once."""
    n = np.array([st.n_units for st in storages], dtype=np.int64)
    unit = np.array([st.unit_bytes for st in storages], dtype=np.int64)
    nbytes = np.array([st.nbytes for st in storages], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(n)])  # each tensor's first global unit
    bases = np.concatenate([[0], np.cumsum(nbytes)])  # and its first byte
    total, last = int(bases[-1]), len(storages) - 1

    def cum(k: np.ndarray) -> np.ndarray:  # bytes before global unit k: every unit but a tensor's last is full
        t = np.minimum(np.searchsorted(starts, k, side="right") - 1, last)
        u = k - starts[t]
        return bases[t] + np.where(u < n[t], u * unit[t], nbytes[t])

    # Python's int / int (correctly rounded), as the engine computes each rank's ideal cut
    ideal = np.array([r * total / world_size for r in range(1, world_size)], dtype=np.float64)
    t = np.minimum(np.searchsorted(bases[1:], ideal, side="left"), last)  # the tensor the cut falls in
    above = np.ceil(ideal).astype(np.int64) - bases[t]  # boundaries are integers: >= ideal iff >= ceil
    j = np.minimum(np.maximum(-(-above // unit[t]), 0), n[t])
    hi = np.where(ideal > 0, starts[t] + j, 0)  # the first boundary at or past the ideal cut
    lo = np.maximum(hi - 1, 0)
    best = np.where(ideal - cum(lo) <= cum(hi) - ideal, lo, hi)
    cuts = np.maximum.accumulate(np.concatenate([[0], best, [starts[-1]]]))
    return cum(cuts)


def plan_quantized_group(
    group: str,
    tensors: Sequence[tuple[str, QuantizedStorage]],
    world_size: int,
    alignment_bytes: int,
    *,
    gathers_per_step: int = 2,
    memo: Memo | None = None,
) -> QuantizedGroupBytes:
    """The frozen quantized bytes of ``tensors`` (name, storage; in the group's order) on ``world_size`` ranks;
    groups of the same storages share one computation through ``memo``."""
    storages = [st for _, st in tensors]
    key = ("quantized", tuple(storages), world_size, alignment_bytes)
    hit: tuple[tuple[int, ...], int] | None = memo.get(key) if memo is not None else None
    if hit is None:
        rank_bytes = tuple(np.diff(_cuts(storages, world_size)).tolist())
        largest = max(rank_bytes, default=0)
        hit = rank_bytes, max(ceil_div(largest, alignment_bytes) * alignment_bytes, alignment_bytes)
        if memo is not None:
            memo[key] = hit
    rank_bytes, S = hit
    shared: dict[str, int] = {}
    for st in storages:
        shared.update(st.shared_constants)
    return QuantizedGroupBytes(
        group=group,
        world_size=world_size,
        tensors=tuple(name for name, _ in tensors),
        numel=sum(st.numel for st in storages),
        payload_bytes=sum(st.sections[0].nbytes for st in storages),
        total_bytes=sum(st.nbytes for st in storages),
        segment_bytes=S,
        rank_bytes=rank_bytes,
        constant_bytes=sum(shared.values()) + sum(st.tensor_constant_bytes for st in storages),
        gathers_per_step=gathers_per_step,
    )


def byte_totals(groups: Sequence[Any], world_size: int) -> dict[str, int | float]:
    """What the quantized byte plans (of frozen weights, or gathered quantized) have in common, summed:
    tensors, payload and scales, per rank (max and mean over ranks), gathered per step."""
    held = np.zeros(world_size, dtype=np.int64)
    for g in groups:
        held += np.asarray(g.rank_bytes, dtype=np.int64)
    gathered = sum(g.gathers_per_step * g.gathered_bytes for g in groups)
    total = sum(g.total_bytes for g in groups)
    physical = sum(g.gathers_per_step * g.total_bytes for g in groups)  # payload and scales, unpadded
    return {
        "num_tensors": sum(len(g.tensors) for g in groups),
        "numel": sum(g.numel for g in groups),
        "payload_bytes": sum(g.payload_bytes for g in groups),
        "scale_bytes": sum(g.scale_bytes for g in groups),
        "total_bytes": total,
        "rank_bytes_max": int(held.max(initial=0)),
        "rank_bytes_mean": total / world_size,
        "segment_bytes_per_rank": sum(g.segment_bytes for g in groups),
        "gathered_bytes_per_step_per_rank": gathered,
        "gathered_bytes_per_step_total": world_size * gathered,
        # what the gathers would move without padding, and the honest ratio ([Note: honest ratios] in _qgather.py)
        "physical_bytes_per_step_per_rank": physical,
        "gathered_over_physical": gathered / physical if physical else 0.0,
    }


def quantized_totals(groups: Sequence[QuantizedGroupBytes], world_size: int) -> dict[str, int | float]:
    """Bytes of ``groups`` together: per rank (max and mean over ranks), gathered per step, and bf16's."""
    out = byte_totals(groups, world_size)
    gathered = out["gathered_bytes_per_step_per_rank"]
    bf16 = sum(g.gathers_per_step * g.bf16_bytes for g in groups)
    out["constant_bytes_per_rank"] = sum(g.constant_bytes for g in groups)
    out["bf16_gathered_bytes_per_step_per_rank"] = bf16
    out["gathered_over_bf16"] = gathered / bf16 if bf16 else 0.0
    return out
