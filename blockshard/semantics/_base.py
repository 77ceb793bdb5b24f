"""The ``BlockSemantics`` interface: what a tensor's indivisible unit is."""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from blockshard._errors import SemanticsError
from blockshard.semantics._grid import UnitGrid

if TYPE_CHECKING:
    from blockshard.semantics._storage import QuantizedStorage

__all__ = ["BlockSemantics", "Companion", "SemanticsKind"]


class SemanticsKind(enum.Enum):
    """What a semantics describes. Two semantics of the same exclusive kind cannot share a tensor."""

    LAYOUT = "layout"  # a layout preference (rows, flat runs, experts): combines with anything
    OPTIMIZER = "optimizer"  # the optimizer that steps the tensor: one per tensor
    QUANTIZER = "quantizer"  # the storage format of the tensor: one per tensor

    @property
    def exclusive(self) -> bool:
        return self is not SemanticsKind.LAYOUT


@dataclass(frozen=True, kw_only=True)
class Companion:
    """A tensor that must travel with its parent's units (e.g. one absmax per quantization block).

    Each unit of the parent carries ``per_unit`` companion elements, so a parent piece holding
    units ``[i, j)`` carries companion elements ``[i * per_unit, j * per_unit)``.
    """

    suffix: str
    numel: int
    dtype: str
    per_unit: int


class BlockSemantics(ABC):
    """A named rule that gives a tensor its unit grids, companions and compute cost.

    Subclass it and register it with :func:`blockshard.register_semantics`; ``grid`` raises
    :class:`~blockshard.SemanticsError` (a ``ValueError``) naming the tensor, the shape, the
    constraint and the fix when a shape cannot be divided into units.

    [Note: placement and compute units]
    A semantics states two grids. :meth:`grid` gives the **compute units**: what one optimizer
    (or quantizer) call must see whole — a Muon matrix, a stripe of whole Shampoo tiles, one
    expert. :meth:`placement_grid` gives the **placement units**: what a shard boundary may not
    cut, because the *storage* must keep it whole — an 8-bit optimizer block, a quantization
    group. The placement grid defaults to :meth:`grid` (the two coincide, as for quantizers and
    for every semantics written before the distinction), so an existing semantics behaves as it
    did. Under the ``whole`` policy the planner lays a tensor out on its compute grid (each
    compute unit on one rank); under ``owner`` on its placement grid, and each compute unit that
    a rank boundary cuts gets an owner rank. ``per_expert = True`` makes the semantics act on
    each expert's ``shape[1:]`` of a stacked expert tensor (see ``semantics/_experts.py``).
    """

    #: What the semantics describes; optimizers and quantizers are exclusive per tensor.
    kind: SemanticsKind = SemanticsKind.LAYOUT
    #: Tensors with fewer dims are left element-wise by blanket rules (``--semantics fp8_block``).
    min_ndim: int = 0
    #: On a stacked expert tensor ``(E, m, n)``, act on each expert's ``(m, n)`` (grids and cost).
    per_expert: ClassVar[bool] = False
    #: The name :func:`blockshard.register_semantics` gave the class (``None``: not registered).
    _registered_name: ClassVar[str | None] = None

    def __init__(self) -> None:
        self.spec = self.name_of()

    @classmethod
    def name_of(cls) -> str:
        return cls._registered_name or cls.__name__

    @abstractmethod
    def grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        """Where a tensor of ``shape`` and ``dtype`` may be cut."""

    def placement_grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        """Where the storage of a tensor may be cut (default: :meth:`grid`, the compute units)."""
        return self.grid(shape, dtype, tensor=tensor)

    def companions(self, shape: tuple[int, ...], dtype: str) -> tuple[Companion, ...]:
        """Tensors that travel with this one's units (none by default)."""
        return ()

    def storage(self, shape: tuple[int, ...], dtype: str) -> QuantizedStorage | None:
        """The byte sections a quantizer stores for the tensor ([Note: quantized storage] in
        ``_storage.py``), what ``blockshard plan`` counts as quantized bytes; ``None``: not a
        quantized storage format (the tensor is stored in its dtype). Called after :meth:`grid`."""
        return None

    def cost(self, shape: tuple[int, ...], dtype: str) -> float:
        """Compute cost of the whole tensor (for balancing owners); default: its element count."""
        return float(math.prod(shape))

    def error(self, tensor: str, shape: tuple[int, ...], constraint: str, fix: str) -> SemanticsError:
        return SemanticsError(
            f"semantics {self.spec!r} cannot divide tensor {tensor!r} of shape {tuple(shape)} into "
            f"units: {constraint}. Fix: {fix}"
        )

    def __repr__(self) -> str:
        return f"<BlockSemantics {self.spec}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockSemantics) and type(other) is type(self) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash((type(self), self.spec))
