"""Padding-aware collective planning: when one all-gather per group pads too much, use several.

[Note: why buckets]
In one bucket every tensor of at least ``2 S`` elements covers a whole segment, so ``S`` must be
a multiple of each such tensor's unit. Two large tensors with different units (Mixtral's stacked
``gate_up`` and ``down`` experts under Muon, DeepSeek's ``gate/up`` and ``down`` 128-row FP8
stripes) then force ``S`` up to a multiple of the least common multiple of their units, and a
few large units leave gaps no small tensor can fill. Giving each unit size its own bucket (its
own ``all_gather_into_tensor`` over a slice of the same persistent buffers) removes the
conflict: each bucket only rounds to its own unit. The search starts from one bucket per unit
size, merges pairs back while a merge costs less than ``MERGE_TOLERANCE``, then moves single
tensors between buckets where that lowers the sum of segments. Tensors stay contiguous views, so nothing is
copied; the price is one more collective per extra bucket, which is why a split must save at
least ``MIN_GAIN_PER_BUCKET`` of ``S`` per extra bucket, and buckets are merged back whenever
merging costs less than ``MERGE_TOLERANCE``.
"""

from __future__ import annotations

from collections.abc import Sequence

from blockshard.planner._pack import lower_bound, pack
from blockshard.semantics import UnitGrid

__all__ = ["MERGE_TOLERANCE", "MIN_GAIN_PER_BUCKET", "plan_buckets"]

#: A layout within this fraction of the lower bound is kept in one bucket without trying more.
GOOD_ENOUGH = 0.002
#: Each extra bucket (collective) must shrink the per-rank segment by at least this fraction.
MIN_GAIN_PER_BUCKET = 0.005
#: Two buckets are merged when the merged one is at most this fraction larger than both together.
MERGE_TOLERANCE = 0.002


def plan_buckets(
    grids: Sequence[UnitGrid], world_size: int, alignment_numel: int
) -> tuple[tuple[int, ...], list[int], list[int], int]:
    """Returns ``(S per bucket, bucket of each tensor, offset of each tensor in its bucket, lower bound)``."""
    n = len(grids)
    lb = lower_bound(grids, world_size, alignment_numel)
    S1, offsets1, _ = pack(grids, world_size, alignment_numel)
    single = ((S1,), [0] * n, offsets1, lb)
    if S1 <= lb * (1 + GOOD_ENOUGH) or n == 1:
        return single
    # Finest split: one bucket per unit size (whole tensors together: they never straddle, so they
    # impose no multiple on S), then merge back greedily.
    parts: dict[object, list[int]] = {}
    for i, g in enumerate(grids):
        parts.setdefault(None if g.is_whole else g.unit_numel, []).append(i)
    if len(parts) == 1:
        return single
    buckets = sorted(parts.values(), key=lambda ix: ix[0])
    planned = [pack([grids[i] for i in ix], world_size, alignment_numel) for ix in buckets]
    merged = True
    while merged and len(buckets) > 1:  # merge back whatever does not pay for its collective
        merged = False
        for a in range(len(buckets)):
            for b in range(a + 1, len(buckets)):
                ix = sorted(buckets[a] + buckets[b])
                trial = pack([grids[i] for i in ix], world_size, alignment_numel)
                if trial[0] <= (planned[a][0] + planned[b][0]) * (1 + MERGE_TOLERANCE):
                    buckets[a], planned[a] = ix, trial
                    del buckets[b], planned[b]
                    merged = True
                    break
            if merged:
                break
    _move_tensors(grids, buckets, planned, world_size, alignment_numel)
    total = sum(p[0] for p in planned)
    if len(buckets) == 1 or total > S1 * (1 - MIN_GAIN_PER_BUCKET * (len(buckets) - 1)):
        return single
    bucket_of, offsets = [0] * n, [0] * n
    for b, (ix, (_, offs, _)) in enumerate(zip(buckets, planned, strict=True)):
        for j, i in enumerate(ix):
            bucket_of[i], offsets[i] = b, offs[j]
    return tuple(p[0] for p in planned), bucket_of, offsets, lb


def _move_tensors(
    grids: Sequence[UnitGrid],
    buckets: list[list[int]],
    planned: list[tuple[int, list[int], int]],
    world_size: int,
    alignment_numel: int,
) -> None:
    """One pass, smallest tensors first: move a tensor to another bucket where that lowers the sum
    of segments (e.g. into the slack a bucket of large stripes leaves on some ranks)."""
    if len(buckets) < 2:
        return
    for i in sorted(range(len(grids)), key=lambda i: (grids[i].numel, i)):
        src = next(b for b, ix in enumerate(buckets) if i in ix)
        if len(buckets[src]) == 1:
            continue
        rest = [j for j in buckets[src] if j != i]
        rest_plan = pack([grids[j] for j in rest], world_size, alignment_numel)
        for dst in range(len(buckets)):
            if dst == src:
                continue
            grown = sorted(buckets[dst] + [i])
            grown_plan = pack([grids[j] for j in grown], world_size, alignment_numel)
            if rest_plan[0] + grown_plan[0] < planned[src][0] + planned[dst][0]:
                buckets[src], planned[src] = rest, rest_plan
                buckets[dst], planned[dst] = grown, grown_plan
                break
