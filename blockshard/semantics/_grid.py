"""``UnitGrid``: where a tensor may be cut.

[Note: unit grid]
A tensor is cut only at offsets (into its row-major flattening) that are multiples of
``unit_numel`` and lie in ``[min_cut, max_cut]``. Plain block semantics use
``min_cut = unit_numel`` and ``max_cut = the last multiple below numel``: every unit is whole,
the last one may be shorter (a remainder block). Optimizers that change numerics below a minimum
size (bitsandbytes and torchao keep fp32 state below 4096 elements) raise ``min_cut`` and lower
``max_cut`` so that no piece of a large tensor falls below that size. A grid with no allowed cut
(``min_cut > max_cut``) keeps the tensor whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from blockshard._arith import round_up
from blockshard._errors import SemanticsError

__all__ = ["GridError", "UnitGrid"]


class GridError(SemanticsError):
    """A :class:`UnitGrid` whose fields are inconsistent (a custom semantics' ``grid()`` built it wrong).

    The resolver re-raises it naming the semantics and the tensor."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class UnitGrid:
    numel: int
    unit_numel: int
    min_cut: int
    max_cut: int

    def __post_init__(self) -> None:
        fields = (self.numel, self.unit_numel, self.min_cut, self.max_cut)
        if not all(_is_int(x) for x in fields) or self.numel < 0 or self.unit_numel < 1:
            self._fail("numel must be an integer >= 0 and unit_numel one >= 1 (all four fields integers)")
        if self.min_cut > self.max_cut:  # canonical "whole" form
            object.__setattr__(self, "unit_numel", max(self.numel, 1))
            object.__setattr__(self, "min_cut", max(self.numel, 1))
            object.__setattr__(self, "max_cut", 0)
            return
        if self.min_cut % self.unit_numel or self.max_cut % self.unit_numel:
            self._fail("min_cut and max_cut must be multiples of unit_numel")
        if not 0 < self.min_cut <= self.max_cut < self.numel:
            self._fail("cuts must lie inside the tensor: 0 < min_cut <= max_cut < numel")

    def _fail(self, constraint: str) -> None:
        raise GridError(
            f"UnitGrid(numel={self.numel!r}, unit_numel={self.unit_numel!r}, min_cut={self.min_cut!r}, "
            f"max_cut={self.max_cut!r}) is inconsistent: {constraint}. Build grids with UnitGrid.units(numel, "
            "unit_numel) or UnitGrid.whole(numel)"
        )

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def units(cls, numel: int, unit_numel: int, *, min_piece: int = 0) -> UnitGrid:
        """Cuts at every multiple of ``unit_numel`` (remainder unit allowed), no piece < ``min_piece``."""
        if not (_is_int(numel) and _is_int(unit_numel) and _is_int(min_piece)) or unit_numel < 1:
            raise GridError(
                f"UnitGrid.units(numel={numel!r}, unit_numel={unit_numel!r}, min_piece={min_piece!r}): "
                "unit_numel must be an integer >= 1 (numel and min_piece integers); pass e.g. unit_numel=256"
            )
        lo = max(unit_numel, round_up(min_piece, unit_numel))
        hi = ((numel - max(min_piece, 1)) // unit_numel) * unit_numel if numel > 0 else 0
        return cls(numel, unit_numel, lo, hi)

    @classmethod
    def whole(cls, numel: int) -> UnitGrid:
        return cls(numel, max(numel, 1), max(numel, 1), 0)

    # -- queries --------------------------------------------------------------------------------
    @property
    def is_whole(self) -> bool:
        return self.min_cut > self.max_cut

    @property
    def largest_unit(self) -> int:
        """The largest piece that can never be split (what a segment must be able to hold)."""
        if self.is_whole:
            return self.numel
        return max(self.min_cut, self.numel - self.max_cut, self.unit_numel)

    @property
    def num_units(self) -> int:
        """Number of indivisible pieces when cut at every allowed offset."""
        if self.is_whole:
            return 1 if self.numel else 0
        return (self.max_cut - self.min_cut) // self.unit_numel + 2

    def allows_cut(self, offset: int) -> bool:
        """Whether a shard boundary may fall ``offset`` elements into the tensor (0 and numel always may)."""
        if offset <= 0 or offset >= self.numel:
            return True
        return self.min_cut <= offset <= self.max_cut and offset % self.unit_numel == 0

    def combine(self, other: UnitGrid) -> UnitGrid:
        """The grid whose cuts are allowed by both (the least common unit)."""
        if self.numel != other.numel:
            raise GridError(f"cannot combine grids of {self.numel} and {other.numel} elements: {self} and {other}")
        if self.is_whole or other.is_whole:
            return UnitGrid.whole(self.numel)
        unit = math.lcm(self.unit_numel, other.unit_numel)
        lo = round_up(max(self.min_cut, other.min_cut), unit)
        hi = (min(self.max_cut, other.max_cut) // unit) * unit
        return UnitGrid(self.numel, unit, lo, hi)
