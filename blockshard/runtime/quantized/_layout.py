"""The layout of a group's frozen quantized weights: whole quantization units cut into equal byte segments.

[Note: quantized layout]
A quantized tensor is a few byte *sections* (bitsandbytes ``Params4bit``: the packed payload, its
absmax, with nested statistics the absmax of the absmax) that share one unit grid: unit ``k``
owns bytes ``[k * unit_bytes, (k + 1) * unit_bytes)`` of every section (the last unit may be
shorter). A rank holds whole units, each with all its sections' bytes (the companions travel with
their payload, never replicated). The tensors of one group are concatenated in order, unit by
unit, and rank ``r``'s cut is the unit boundary nearest to ``r * total / W``; every rank's segment
is padded to the largest, ``S`` bytes (a multiple of the alignment), so one
``all_gather_into_tensor`` of ``uint8 [S]`` moves the group: the gathered buffer holds rank ``r``'s
pieces at ``[r * S, (r + 1) * S)``, each piece's sections one after another. Bytes travel as bytes:
a bf16-stored payload is moved as its ``uint8`` view, so no NaN pattern is canonicalized.
The imbalance is at most one unit (8448 bytes for nested NF4 with 64-value blocks).
This module is pure (no torch.distributed): every rank computes the same layout from the shapes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

__all__ = ["QuantizedLayout", "QuantizedPiece", "SectionShape", "plan_quantized"]


@dataclass(frozen=True, slots=True)
class SectionShape:
    """One byte section of a quantized tensor: ``nbytes`` in all, ``unit_bytes`` per unit; or,
    where units differ by runs (a tile-placed FP8 weight: full tiles, then its edge tiles),
    ``runs``: ``(units, bytes each)`` in order."""

    name: str
    nbytes: int
    unit_bytes: int
    runs: tuple[tuple[int, int], ...] = ()

    def unit_offset(self, unit: int) -> int:
        """The first byte of unit ``unit`` (``nbytes`` past the last)."""
        if not self.runs:
            return min(unit * self.unit_bytes, self.nbytes)
        at = 0
        for n, size in self.runs:
            if unit <= n:
                return at + unit * size
            at, unit = at + n * size, unit - n
        return at

    def byte_range(self, unit_start: int, unit_stop: int) -> tuple[int, int]:
        return self.unit_offset(unit_start), self.unit_offset(unit_stop)

    def unit_sizes(self, n_units: int) -> np.ndarray:
        """Every unit's bytes."""
        if self.runs:
            sizes = np.concatenate([np.full(n, size, dtype=np.int64) for n, size in self.runs])
            assert len(sizes) == n_units and int(sizes.sum()) == self.nbytes, (self, n_units)
            return sizes
        k = np.arange(n_units, dtype=np.int64)
        return np.minimum((k + 1) * self.unit_bytes, self.nbytes) - np.minimum(k * self.unit_bytes, self.nbytes)


@dataclass(frozen=True, slots=True)
class QuantizedPiece:
    """Units ``[unit_start, unit_stop)`` of tensor ``tensor`` held by one rank; ``ranges`` gives,
    per section, ``(section_lo, section_hi, segment_offset)`` in bytes."""

    tensor: int
    unit_start: int
    unit_stop: int
    ranges: tuple[tuple[int, int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(hi - lo for lo, hi, _ in self.ranges)


@dataclass(frozen=True, slots=True)
class QuantizedLayout:
    """Every rank's pieces and the common segment size ``segment_bytes`` (see [Note: quantized layout])."""

    world_size: int
    segment_bytes: int
    total_bytes: int  # payload and companions of every tensor, without padding
    pieces: tuple[tuple[QuantizedPiece, ...], ...]  # by rank

    def rank_bytes(self, rank: int) -> int:
        return sum(p.nbytes for p in self.pieces[rank])

    def layout_hash(self) -> str:
        text = repr((self.world_size, self.segment_bytes, self.pieces))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _unit_sizes(sections: tuple[SectionShape, ...], n_units: int) -> np.ndarray:
    out = np.zeros(n_units, dtype=np.int64)
    for s in sections:
        out += s.unit_sizes(n_units)
    return out


def plan_quantized(
    tensors: list[tuple[tuple[SectionShape, ...], int]], world_size: int, alignment_bytes: int
) -> QuantizedLayout:
    """Cut ``tensors`` (each: its sections and unit count) into ``world_size`` segments of whole units."""
    sizes = [_unit_sizes(sections, n) for sections, n in tensors]
    flat = np.concatenate(sizes) if sizes else np.zeros(0, dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(flat)])  # cum[k]: bytes before global unit k
    total = int(cum[-1])
    cuts = [0]
    for r in range(1, world_size):
        ideal = r * total / world_size
        hi = int(np.searchsorted(cum, ideal))  # first boundary at or past the ideal cut
        lo = max(hi - 1, 0)
        best = lo if hi >= len(cum) or ideal - cum[lo] <= cum[hi] - ideal else hi
        cuts.append(max(best, cuts[-1]))
    cuts.append(len(flat))
    starts = np.concatenate([[0], np.cumsum([n for _, n in tensors])])  # first global unit of each tensor
    by_rank = []
    for r in range(world_size):
        a, b = cuts[r], cuts[r + 1]
        pieces, offset = [], 0
        for t, (sections, _) in enumerate(tensors):
            i, j = max(a, int(starts[t])) - int(starts[t]), min(b, int(starts[t + 1])) - int(starts[t])
            if i >= j:
                continue
            ranges = []
            for s in sections:
                lo, hi = s.byte_range(i, j)
                ranges.append((lo, hi, offset))
                offset += hi - lo
            pieces.append(QuantizedPiece(t, i, j, tuple(ranges)))
        by_rank.append(tuple(pieces))
    largest = max((sum(p.nbytes for p in ps) for ps in by_rank), default=0)
    S = -(-largest // alignment_bytes) * alignment_bytes
    return QuantizedLayout(world_size, max(S, alignment_bytes), total, tuple(by_rank))
