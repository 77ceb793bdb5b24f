"""``QuantizedStorage``: the bytes a quantizer stores for one tensor, as the engine shards them.

[Note: quantized storage]
A quantized weight is a few byte *streams* on one unit grid (bitsandbytes ``Params4bit``: the
packed payload and its absmax; with nested statistics also the absmax of the absmax): unit ``k``
owns bytes ``[k * unit_bytes, (k + 1) * unit_bytes)`` of every stream, the last unit may be
shorter. This is the engine's ``StreamShape`` ([Note: quantized layout] in
``runtime/quantized/_layout.py``) stated from a shape alone, so ``blockshard plan`` predicts the
bytes ``fully_shard`` holds and gathers (``tests/quantized/test_fast_plan_bytes.py`` checks that
they are equal). Constants every rank keeps whole (code tables, one per group however many tensors
share them; per-tensor offsets) are ``shared_constants`` and ``tensor_constant_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockshard._arith import ceil_div
from blockshard._errors import SemanticsError
from blockshard.semantics._base import Companion
from blockshard.semantics._spec import itemsize_of

__all__ = ["ByteStream", "QuantizedStorage", "storage_with_companions"]


@dataclass(frozen=True, slots=True)
class ByteStream:
    """One byte stream of a quantized tensor: ``nbytes`` in all, ``unit_bytes`` per (full) unit."""

    name: str
    nbytes: int
    unit_bytes: int


@dataclass(frozen=True)
class QuantizedStorage:
    """How a quantizer stores a tensor of ``numel`` values in units of ``unit_numel`` values
    (see [Note: quantized storage])."""

    format: str  # e.g. "bitsandbytes nf4 (nested absmax)"
    numel: int
    unit_numel: int
    streams: tuple[ByteStream, ...]
    shared_constants: tuple[tuple[str, int], ...] = ()  # (what, bytes): kept once per group
    tensor_constant_bytes: int = 0  # kept once per tensor, on every rank

    def __post_init__(self) -> None:
        n = self.n_units
        for s in self.streams:
            # every unit but the last is full in every stream, so unit k starts at k * unit_bytes
            fits = (n - 1) * s.unit_bytes < s.nbytes <= n * s.unit_bytes if n else s.nbytes == 0
            if s.unit_bytes < 1 or not fits:
                raise SemanticsError(
                    f"{self.format}: stream {s.name!r} of {s.nbytes} bytes at {s.unit_bytes} bytes per unit does "
                    f"not fill {n} units of {self.unit_numel} values (only the last unit may be shorter). Fix "
                    "the semantics' storage(): a stream's bytes per unit times its units, the last one partial"
                )

    @property
    def n_units(self) -> int:
        return ceil_div(self.numel, self.unit_numel)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.streams)

    @property
    def unit_bytes(self) -> int:
        """Bytes of one full unit, every stream together."""
        return sum(s.unit_bytes for s in self.streams)

    @property
    def scale_bytes(self) -> int:
        """Bytes of every stream but the payload (the first): absmax, scales, factors."""
        return sum(s.nbytes for s in self.streams[1:])

    def bytes_before(self, unit: int) -> int:
        """Bytes of units ``[0, unit)``, every stream together."""
        return sum(min(unit * s.unit_bytes, s.nbytes) for s in self.streams)


def storage_with_companions(
    fmt: str,
    numel: int,
    unit_numel: int,
    payload_bits: int,
    companions: tuple[Companion, ...],
    *,
    shared_constants: tuple[tuple[str, int], ...] = (),
    tensor_constant_bytes: int = 0,
) -> QuantizedStorage:
    """A payload of ``payload_bits`` per value, then one stream per companion (in its dtype)."""
    payload = ByteStream("payload", numel * payload_bits // 8, unit_numel * payload_bits // 8)
    streams = [payload]
    for c in companions:
        size = itemsize_of(c.dtype)
        streams.append(ByteStream(c.suffix, c.numel * size, c.per_unit * size))
    return QuantizedStorage(fmt, numel, unit_numel, tuple(streams), shared_constants, tensor_constant_bytes)
