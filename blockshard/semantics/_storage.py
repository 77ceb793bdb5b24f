"""``QuantizedStorage``: the bytes a quantizer stores for one tensor, as the engine shards them.

[Note: quantized storage]
A quantized weight is a few byte *sections* on one unit grid (bitsandbytes ``Params4bit``: the
packed payload and its absmax; with nested statistics also the absmax of the absmax): unit ``k``
owns bytes ``[k * unit_bytes, (k + 1) * unit_bytes)`` of every section, the last unit may be
shorter. This is the engine's ``SectionShape`` ([Note: quantized layout] in
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

__all__ = ["ByteSection", "ByteStream", "QuantizedStorage", "storage_with_companions"]


@dataclass(frozen=True, slots=True)
class ByteSection:
    """One byte section of a quantized tensor: ``nbytes`` in all, ``unit_bytes`` per (full) unit."""

    name: str
    nbytes: int
    unit_bytes: int


ByteStream = ByteSection  # its name before "stream" meant only a CUDA stream (kept: a public name)


@dataclass(frozen=True, init=False)
class QuantizedStorage:
    """How a quantizer stores a tensor of ``numel`` values in units of ``unit_numel`` values
    (see [Note: quantized storage]). ``streams=`` and ``.streams`` are the former names of
    ``sections``, still accepted."""

    format: str  # e.g. "bitsandbytes nf4 (nested absmax)"
    numel: int
    unit_numel: int
    sections: tuple[ByteSection, ...]
    shared_constants: tuple[tuple[str, int], ...] = ()  # (what, bytes): kept once per group
    tensor_constant_bytes: int = 0  # kept once per tensor, on every rank

    def __init__(
        self,
        format: str,
        numel: int,
        unit_numel: int,
        sections: tuple[ByteSection, ...] | None = None,
        shared_constants: tuple[tuple[str, int], ...] = (),
        tensor_constant_bytes: int = 0,
        *,
        streams: tuple[ByteSection, ...] | None = None,
    ) -> None:
        if (sections is None) == (streams is None):
            raise TypeError(
                "QuantizedStorage() takes the byte sections once: sections=(ByteSection(...), ...) (streams= is "
                f"their former name); got sections={sections!r}, streams={streams!r}"
            )
        values = (format, numel, unit_numel, sections if streams is None else streams)
        for name, value in zip(("format", "numel", "unit_numel", "sections"), values, strict=True):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "shared_constants", shared_constants)
        object.__setattr__(self, "tensor_constant_bytes", tensor_constant_bytes)
        self._check()

    @property
    def streams(self) -> tuple[ByteSection, ...]:
        """The former name of :attr:`sections`."""
        return self.sections

    def _check(self) -> None:
        n = self.n_units
        for s in self.sections:
            # every unit but the last is full in every section, so unit k starts at k * unit_bytes
            fits = (n - 1) * s.unit_bytes < s.nbytes <= n * s.unit_bytes if n else s.nbytes == 0
            if s.unit_bytes < 1 or not fits:
                raise SemanticsError(
                    f"{self.format}: section {s.name!r} of {s.nbytes} bytes at {s.unit_bytes} bytes per unit does "
                    f"not fill {n} units of {self.unit_numel} values (only the last unit may be shorter). Fix "
                    "the semantics' storage(): a section's bytes per unit times its units, the last one partial"
                )

    @property
    def n_units(self) -> int:
        return ceil_div(self.numel, self.unit_numel)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sections)

    @property
    def unit_bytes(self) -> int:
        """Bytes of one full unit, every section together."""
        return sum(s.unit_bytes for s in self.sections)

    @property
    def scale_bytes(self) -> int:
        """Bytes of every section but the payload (the first): absmax, scales, factors."""
        return sum(s.nbytes for s in self.sections[1:])

    def bytes_before(self, unit: int) -> int:
        """Bytes of units ``[0, unit)``, every section together."""
        return sum(min(unit * s.unit_bytes, s.nbytes) for s in self.sections)


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
    """A payload of ``payload_bits`` per value, then one section per companion (in its dtype)."""
    payload = ByteSection("payload", numel * payload_bits // 8, unit_numel * payload_bits // 8)
    sections = [payload]
    for c in companions:
        size = itemsize_of(c.dtype)
        sections.append(ByteSection(c.suffix, c.numel * size, c.per_unit * size))
    return QuantizedStorage(fmt, numel, unit_numel, tuple(sections), shared_constants, tensor_constant_bytes)
