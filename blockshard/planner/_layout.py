"""``GroupLayout``: where every tensor of one group lives in the gathered buffer.

[Note: layout invariants]
A group's layout is a sequence of *buckets* (usually one). Bucket ``b`` has a segment size
``S_b``; its gathered region holds ``W * S_b`` elements and rank ``r`` owns
``[r * S_b, (r + 1) * S_b)`` of it. The group's gathered buffer is the buckets' regions one after
another, and each rank's persistent local buffer is its segments of every bucket one after
another (``S = sum(S_b)`` elements), so bucket ``b`` is one ``all_gather_into_tensor`` between
a slice of the local buffer and a slice of the gathered buffer. A layout is valid when, in every
bucket:
  1. tensors do not overlap and each is contiguous (a view of the gathered buffer);
  2. holes (padding) lie only between tensors or after the last one;
  3. every rank boundary ``k * S_b`` strictly inside a tensor falls on an allowed cut of its grid;
  4. ``S_b`` is a multiple of the alignment.
:meth:`GroupLayout.check` asserts all four; every layout the planner returns satisfies them.
Several buckets cost one collective each; the planner uses them only where units force much
padding into a single one (see ``_buckets.py``).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Any

from blockshard._errors import PlanError
from blockshard.planner._units import layout_hash, rank_overlap
from blockshard.semantics import UnitGrid

__all__ = ["GroupLayout", "Piece", "TensorPlacement"]

LAYOUT_FORMAT_VERSION = 1


@dataclass(frozen=True)
class TensorPlacement:
    name: str
    shape: tuple[int, ...]
    offset: int  # start within its bucket's gathered region
    grid: UnitGrid
    semantics: str = "elementwise"
    bucket: int = 0

    @property
    def numel(self) -> int:
        return self.grid.numel

    @property
    def end(self) -> int:
        return self.offset + self.grid.numel


@dataclass(frozen=True)
class Piece:
    """The part of a tensor one rank holds: tensor elements ``[start, start + numel)`` at
    ``local_offset`` in that rank's local buffer."""

    index: int  # index of the tensor in ``GroupLayout.tensors``
    start: int
    numel: int
    local_offset: int


@dataclass(frozen=True)
class GroupLayout:
    name: str
    world_size: int
    alignment_numel: int  # every S_b is a multiple of it (``plan_group``'s ``alignment_bytes`` in elements)
    dtype: str
    itemsize: int
    lower_bound: int
    buckets: tuple[int, ...]  # S_b per bucket
    tensors: tuple[TensorPlacement, ...]  # sorted by (bucket, offset)
    _ends: dict[int, tuple[int, list[int]]] = field(default_factory=dict, init=False, repr=False, compare=False)

    # -- geometry ---------------------------------------------------------------------------------
    @property
    def segment_numel(self) -> int:
        """``S``: elements of every rank's local buffer (the sum of the bucket segments)."""
        return sum(self.buckets)

    def bucket_local_offset(self, bucket: int) -> int:
        """Where bucket ``bucket``'s segment starts in every rank's local buffer."""
        return sum(self.buckets[:bucket])

    def bucket_gathered_offset(self, bucket: int) -> int:
        """Where bucket ``bucket``'s region starts in the gathered buffer."""
        return self.world_size * self.bucket_local_offset(bucket)

    def gathered_offset(self, index: int) -> int:
        """Where tensor ``index`` starts in the gathered buffer."""
        t = self.tensors[index]
        return self.bucket_gathered_offset(t.bucket) + t.offset

    # -- metrics ----------------------------------------------------------------------------------
    @property
    def total_numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def padded_numel(self) -> int:
        return self.world_size * self.segment_numel

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.total_numel / self.padded_numel if self.padded_numel else 0.0

    @property
    def segment_over_lower_bound(self) -> float:
        return self.segment_numel / self.lower_bound if self.lower_bound else 1.0

    @property
    def largest_unit(self) -> int:
        return max((t.grid.largest_unit for t in self.tensors), default=0)

    @property
    def allgather_bytes_per_rank(self) -> int:
        """Bytes each rank receives in the group's all-gathers: ``(W - 1) * S * itemsize``."""
        return (self.world_size - 1) * self.segment_numel * self.itemsize

    # -- per rank ---------------------------------------------------------------------------------
    def pieces(self, rank: int) -> list[Piece]:
        """What ``rank`` holds, in local-buffer order (tensors with no elements on it are left out)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise PlanError(
                f"rank={rank!r} must be an integer in [0, {self.world_size}) for group {self.name!r} "
                f"on world size {self.world_size}; pass one of its ranks"
            )
        out: list[Piece] = []
        for b, S in enumerate(self.buckets):
            lo, hi, base = rank * S, (rank + 1) * S, self.bucket_local_offset(b)
            first, ends = self._bucket_ends(b)
            i = first + bisect.bisect_right(ends, lo)
            while i < len(self.tensors) and self.tensors[i].bucket == b and self.tensors[i].offset < hi:
                t = self.tensors[i]
                a, e = max(lo, t.offset), min(hi, t.end)
                if a < e:
                    out.append(Piece(i, a - t.offset, e - a, base + a - lo))
                i += 1
        return out

    def _bucket_ends(self, bucket: int) -> tuple[int, list[int]]:
        hit = self._ends.get(bucket)
        if hit is None:
            idx = [i for i, t in enumerate(self.tensors) if t.bucket == bucket]
            # running maxima: a tensor with no elements ends where it starts, before an earlier
            # tensor's end, and the search needs ends that never decrease
            hit = (
                idx[0] if idx else len(self.tensors),
                list(itertools.accumulate((self.tensors[i].end for i in idx), max)),
            )
            self._ends[bucket] = hit
        return hit

    def rank_numel(self, rank: int) -> int:
        """Real (non-padding) elements ``rank`` holds."""
        return sum(p.numel for p in self.pieces(rank))

    def rank_loads(self) -> list[int]:
        """Real (non-padding) elements of every rank, in O(tensors + W)."""
        ts = self.tensors
        starts, ends = [t.offset for t in ts], [t.end for t in ts]
        loads: list[int] = rank_overlap(starts, ends, [self.buckets[t.bucket] for t in ts], self.world_size).tolist()
        return loads

    # -- invariants -------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the layout invariants (see [Note: layout invariants])."""
        W = self.world_size
        assert W >= 1 and self.alignment_numel >= 1 and self.buckets
        for S in self.buckets:
            assert S > 0 and S % self.alignment_numel == 0, (S, self.alignment_numel)
        prev = (-1, 0)
        for t in self.tensors:
            assert 0 <= t.bucket < len(self.buckets), t
            S = self.buckets[t.bucket]
            prev_end = prev[1] if prev[0] == t.bucket else 0
            assert t.bucket >= prev[0], "tensors are not sorted by bucket"
            assert t.offset >= prev_end, f"{t.name} overlaps its predecessor"
            k = t.offset // S + 1
            while k * S < t.end:
                assert t.grid.allows_cut(k * S - t.offset), f"boundary {k * S} splits a unit of {t.name}"
                k += 1
            assert t.end <= W * S, (t.name, t.end, W * S)
            prev = (t.bucket, t.end)
        assert self.segment_numel >= self.lower_bound, (self.segment_numel, self.lower_bound)

    # -- serialization ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": LAYOUT_FORMAT_VERSION,
            "name": self.name,
            "world_size": self.world_size,
            "alignment": self.alignment_numel,  # elements (the key predates the _numel naming)
            "dtype": self.dtype,
            "itemsize": self.itemsize,
            "lower_bound": self.lower_bound,
            "buckets": list(self.buckets),
            "tensors": [
                {
                    "name": t.name,
                    "shape": list(t.shape),
                    "bucket": t.bucket,
                    "offset": t.offset,
                    "semantics": t.semantics,
                    "grid": [t.grid.numel, t.grid.unit_numel, t.grid.min_cut, t.grid.max_cut],
                }
                for t in self.tensors
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GroupLayout:
        if not isinstance(data, dict) or data.get("format") != LAYOUT_FORMAT_VERSION:
            got = data.get("format") if isinstance(data, dict) else f"a {type(data).__name__}"
            raise PlanError(
                f"layout JSON has format={got!r}, not {LAYOUT_FORMAT_VERSION!r}; pass what "
                "GroupLayout.to_json() wrote (plan again with this version of blockshard)"
            )
        tensors = tuple(
            TensorPlacement(
                d["name"], tuple(d["shape"]), d["offset"], UnitGrid(*d["grid"]), d["semantics"], d["bucket"]
            )
            for d in data["tensors"]
        )
        return cls(
            data["name"],
            data["world_size"],
            data["alignment"],
            data["dtype"],
            data["itemsize"],
            data["lower_bound"],
            tuple(data["buckets"]),
            tensors,
        )

    def layout_hash(self) -> str:
        """A stable hash of the layout (every rank must compute the same one)."""
        return layout_hash(self.to_json())
