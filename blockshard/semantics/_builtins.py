"""Built-in block semantics, with the facts each one encodes.

Each class is registered under the name in its decorator; ``NAME:ARG`` semantics strings pass integer
arguments to the constructor. Sizes are counted in elements of the row-major flattening.

Every built-in states both of its units (see [Note: placement and compute units] in ``_base.py``):

==============  =========================================  ==========================================
semantics       compute unit (``grid``)                    placement unit (``placement_grid``)
==============  =========================================  ==========================================
elementwise     1 element                                  1 element
matrix          the tensor (one per expert)                1 element
rows:k          k rows (per expert)                        1 element
shampoo:D       D rows: whole D x D tiles (per expert)     1 element
flat:n          n elements                                 n elements
bnb8bit, ao*    256 / 128-element state blocks             the same (the storage keeps them whole)
nf4, ao_nf4, mx quantization blocks                        the same
fp8_block:B     B-row stripes of B x B tiles (per expert)  the same (weights are quantized in place)
fp4, *_nested   quantization blocks                        the same
expert          one expert of a stacked (E, ...) tensor    1 element
parts:r1:r2:..  1 element (declares a fused weight's parts) 1 element
==============  =========================================  ==========================================

The quantizers but ``nf4`` (``fp4``, ``nf4_nested``, ``fp4_nested``, ``ao_nf4``, ``mx``, ``fp8_block``)
live in ``_quantizers.py``, with the bytes each stores per unit.

Combined with an 8-bit or quantization semantics, ``matrix``'s placement unit becomes theirs.
"""

from __future__ import annotations

import math

from blockshard._arith import rows_cols
from blockshard._errors import SemanticsError
from blockshard.semantics._base import BlockSemantics, Companion, SemanticsKind
from blockshard.semantics._grid import UnitGrid
from blockshard.semantics._registry import register_semantics
from blockshard.semantics._storage import QuantizedStorage, storage_with_companions

__all__ = [
    "NF4",
    "Ao4bit",
    "Ao8bit",
    "Bnb8bit",
    "Elementwise",
    "Expert",
    "Flat",
    "Matrix",
    "Parts",
    "Rows",
    "Shampoo",
    "fused_parts",
    "newton_schulz_flops",
]

# bitsandbytes (Optimizer2State.init_state) and torchao (_AdamBase._new_buffer) keep plain fp32
# state for tensors below this many elements, so a piece smaller than this computes differently.
MIN_8BIT_NUMEL = 4096


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise SemanticsError(f"semantics {name}:{value}: the argument must be >= 1, got {value}")
    return value


def _fine(shape: tuple[int, ...]) -> UnitGrid:
    """Placement unit of one element: storage may be cut anywhere (the compute unit goes to an owner)."""
    return UnitGrid.units(math.prod(shape), 1)


def newton_schulz_flops(shape: tuple[int, ...], steps: int = 5) -> float:
    """FLOPs of Muon's quintic Newton-Schulz on the 2-D view ``m x n`` (m <= n).

    Each step computes ``A = X X^T`` (2 m^2 n), ``B = bA + cA^2`` (2 m^3) and ``BX`` (2 m^2 n):
    4 m^2 n + 2 m^3 per step, so 20 m^2 n + 10 m^3 for the usual 5 steps.
    """
    rows, cols = rows_cols(shape)
    m, n = sorted((rows, cols))
    return float(steps * (4 * m * m * n + 2 * m**3))


@register_semantics("elementwise")
class Elementwise(BlockSemantics):
    """Every element is its own unit (AdamW, SGD, Adam): any cut is exact."""

    def grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        return UnitGrid.units(math.prod(shape), 1)


@register_semantics("matrix")
class Matrix(BlockSemantics):
    """The whole tensor is one unit: Muon orthogonalizes the full matrix, GaLore projects it.

    Cost for balancing: Newton-Schulz FLOPs (:func:`newton_schulz_flops`) on the 2-D view.
    Compute unit: the tensor (each expert's matrix of a stacked expert tensor); placement unit: 1 element.
    """

    kind = SemanticsKind.OPTIMIZER
    min_ndim = 2
    per_expert = True

    def grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        return UnitGrid.whole(math.prod(shape))

    def placement_grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        return _fine(shape)

    def cost(self, shape: tuple[int, ...], dtype: str) -> float:
        return newton_schulz_flops(shape)


@register_semantics("parts")
class Parts(BlockSemantics):
    """A fused weight: ``k`` matrices stacked along the rows (dim 0) of its 2-D view, of ``r1, r2, ...`` rows.

    [Note: fused parts]
    Fused projections keep several matrices in one parameter: Phi-3's ``qkv_proj`` is ``[q; k; v]``
    (``(n_heads + 2 * n_kv_heads) * head_dim`` rows), its ``gate_up_proj`` ``[gate; up]``, a MoE
    layer's stacked ``gate_up_proj`` ``(E, 2 * I, H)`` the same per expert. Muon is meant per part
    (Newton-Schulz on ``q``, on ``k``, on ``v``, the learning rate adjusted by each part's shape):
    ``parts:r1:r2:...`` declares the split. It is a layout semantics: it asks for no unit of its own
    (the compute units stay the optimizer's: ``matrix`` keeps the fused matrix whole on one rank or
    at its owner, where :class:`blockshard.optim.Muon` splits it into its parts), so it combines with
    ``muon`` (``"muon,*.qkv_proj.weight=parts:64:16:16"``). On a stacked expert tensor the parts are
    each expert's. Under tensor parallelism the parts are stated for the TP-local matrix, and part
    ``i`` of the global matrix is part ``i`` of every tp rank's, joined along the placement's dim
    (the layout Megatron and torchtitan give a fused projection split by heads).

    Who honours it: :class:`blockshard.optim.Muon` (per part, exactly ``torch.optim.Muon`` on the
    parts as separate parameters); ``shampoo:D`` when every part boundary is a multiple of ``D`` rows
    (its stripes then hold whole tiles of one part: per-part Shampoo as it is); element-wise
    optimizers (nothing to split). Anything that would compute on the fused matrix whole instead
    (``torch.optim.Muon`` on a blockshard piece, ``OwnerComputeOptimizer`` around it, Shampoo stripes
    straddling a part boundary) raises, naming the parameter.
    """

    min_ndim = 2
    per_expert = True

    def __init__(self, *rows: int) -> None:
        super().__init__()
        if len(rows) < 2:
            raise SemanticsError(
                f"semantics parts:{':'.join(map(str, rows))}: a fused weight has at least 2 parts; give each part's "
                "rows, e.g. 'parts:4096:1024:1024' for q, k and v"
            )
        self.rows = tuple(_positive("parts", r) for r in rows)
        self.spec = "parts:" + ":".join(map(str, self.rows))

    def grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        rows, _ = rows_cols(shape)
        if len(shape) < 2 or rows != sum(self.rows):
            raise self.error(
                tensor,
                shape,
                f"its parts have {' + '.join(map(str, self.rows))} = {sum(self.rows)} rows, the tensor "
                f"{'has ' + str(rows) + ' rows' if len(shape) >= 2 else 'is not a matrix'}",
                "give the rows of each part along dim 0 of this tensor as the engine holds it (the TP-local matrix "
                "under tensor parallelism, one expert's matrix on stacked experts)",
            )
        return UnitGrid.units(math.prod(shape), 1)


def straddled_boundary(rows: tuple[int, ...], dim: int) -> int | None:
    """The first part boundary of a fused weight of ``rows`` that ``dim``-row tiles straddle (a
    boundary that is not a multiple of ``dim``); None when every tile holds rows of one part."""
    at = 0
    for r in rows[:-1]:
        at += r
        if at % dim:
            return at
    return None


def fused_parts(label: str) -> tuple[int, ...]:
    """The part rows a semantics label (``"matrix+parts:64:16:16"``) declares; ``()`` for none."""
    for item in label.split("+"):
        name, _, args = item.partition(":")
        if name == "parts" and args:
            return tuple(int(a) for a in args.split(":"))
    return ()


@register_semantics("rows")
class Rows(BlockSemantics):
    """Stripes of ``k`` rows of the 2-D view ``(shape[0], prod(shape[1:]))``; a shorter last stripe is allowed.

    Compute unit: a stripe (rows of each expert's matrix on a stacked expert tensor); placement unit: 1 element.
    """

    per_expert = True

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = _positive("rows", k)
        self.spec = f"rows:{k}"

    def grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        _, cols = rows_cols(shape)
        return UnitGrid.units(math.prod(shape), self.k * cols)

    def placement_grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        return _fine(shape)


@register_semantics("shampoo")
class Shampoo(BlockSemantics):
    """Stripes of ``D`` rows so every ``D x D`` preconditioner tile is whole.

    Distributed Shampoo (``max_preconditioner_dim = D``) tiles the 2-D view into ``D x D`` blocks
    (smaller blocks at the edges); a 1-D tensor into runs of ``D``. A stripe of ``D`` full rows
    holds whole tiles, so cutting between stripes never splits a preconditioner.
    Cost: ``sum over tiles (r^3 + c^3)`` (the eigendecompositions of both factors).
    Compute unit: a stripe of ``D`` rows (per expert on a stacked expert tensor); placement unit: 1 element.
    """

    kind = SemanticsKind.OPTIMIZER
    per_expert = True

    def __init__(self, max_preconditioner_dim: int = 1024) -> None:
        super().__init__()
        self.dim = _positive("shampoo", max_preconditioner_dim)
        self.spec = f"shampoo:{self.dim}"

    def grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        numel = math.prod(shape)
        if len(shape) <= 1:
            return UnitGrid.units(numel, self.dim)
        _, cols = rows_cols(shape)
        return UnitGrid.units(numel, self.dim * cols)

    def placement_grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        return _fine(shape)

    def cost(self, shape: tuple[int, ...], dtype: str) -> float:
        rows, cols = rows_cols(shape)
        if len(shape) <= 1:
            rows, cols = math.prod(shape), 1
        d = self.dim
        tiles_r = [min(d, rows - i) for i in range(0, rows, d)]
        tiles_c = [min(d, cols - j) for j in range(0, cols, d)]
        return float(sum(r**3 for r in tiles_r) * len(tiles_c) + sum(c**3 for c in tiles_c) * len(tiles_r))


@register_semantics("flat")
class Flat(BlockSemantics):
    """Runs of ``n`` elements of the flattening (a generic block quantizer); the last run may be shorter."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = _positive("flat", n)
        self.spec = f"flat:{n}"

    def grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        return UnitGrid.units(math.prod(shape), self.n)


class _QuantizedState(BlockSemantics):
    """8-bit / 4-bit optimizer state in blocks of ``block`` elements, fp32 below 4096 elements."""

    kind = SemanticsKind.OPTIMIZER
    block = 256
    needs_divisible = False

    def grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        numel = math.prod(shape)
        if numel < MIN_8BIT_NUMEL or (self.needs_divisible and numel % self.block):
            # One process keeps fp32 state for this tensor: keep it whole so the rank holding it does too.
            return UnitGrid.whole(numel)
        return UnitGrid.units(numel, self.block, min_piece=MIN_8BIT_NUMEL)


@register_semantics("bnb8bit")
class Bnb8bit(_QuantizedState):
    """bitsandbytes 8-bit optimizers (Adam8bit, AdamW8bit, ...): blockwise state, 256-element blocks.

    Facts (bitsandbytes 0.50, ``Optimizer2State.init_state``): state is quantized in runs of 256
    elements from the start of the tensor the optimizer sees; tensors below ``min_8bit_size =
    4096`` elements keep fp32 state. So cuts fall on multiples of 256, no piece of a large tensor
    is smaller than 4096 elements, and tensors below 4096 stay whole (fp32 on the rank holding them, as
    on one process). A shorter last block is fine (bitsandbytes handles a partial block).
    """

    block = 256


@register_semantics("ao8bit")
class Ao8bit(_QuantizedState):
    """torchao ``AdamW8bit``: ``block_size = 256``.

    Facts (torchao 0.18, ``_AdamBase._new_buffer``): state is quantized only when the tensor the
    optimizer sees has ``>= 4096`` elements and a multiple of ``block_size``; otherwise torchao
    silently uses fp32 state. So tensors that are not multiples of 256 stay whole, and pieces of
    the others are multiples of 256 of at least 4096 elements.
    """

    block = 256
    needs_divisible = True


@register_semantics("ao4bit")
class Ao4bit(_QuantizedState):
    """torchao ``AdamW4bit``: ``block_size = 128``; same fp32 fallback rule as ``ao8bit``."""

    block = 128
    needs_divisible = True


@register_semantics("nf4")
class NF4(BlockSemantics):
    """bitsandbytes NF4 (``Params4bit``, QLoRA): quantization blocks of 64 values share one absmax.

    The tensor must hold a whole number of blocks; each block carries one fp32 absmax (a
    companion that travels with its block). Stored (bitsandbytes 0.50, ``compress_statistics=False``):
    32 payload bytes and a 4-byte absmax per block, the 16-value fp32 code once per group. With
    nested statistics (``compress_statistics=True``, QLoRA's double quantization) see ``nf4_nested``.
    """

    kind = SemanticsKind.QUANTIZER
    min_ndim = 2  # blanket rules quantize weights (Linear), not norms or biases
    block_numel = 64  # values per quantization block (one absmax each)
    quant_type = "nf4"

    def grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        return UnitGrid.units(self._blocks(shape, tensor) * self.block_numel, self.block_numel)

    def _blocks(self, shape: tuple[int, ...], tensor: str) -> int:
        numel = math.prod(shape)
        if numel % self.block_numel:
            raise self.error(
                tensor,
                shape,
                f"numel {numel} is not a multiple of the {self.block_numel}-value {self.quant_type.upper()} quantization "
                "block",
                f"quantize only tensors whose size is a multiple of {self.block_numel} (leave this one in bf16 with "
                "an 'elementwise' rule for it)",
            )
        return numel // self.block_numel

    def companions(self, shape: tuple[int, ...], dtype: str) -> tuple[Companion, ...]:
        numel = math.prod(shape)
        return (Companion(suffix="absmax", numel=numel // self.block_numel, dtype="float32", per_unit=1),)

    def storage(self, shape: tuple[int, ...], dtype: str) -> QuantizedStorage:
        code = (f"bitsandbytes {self.quant_type} code", 16 * 4)
        return storage_with_companions(
            f"bitsandbytes {self.quant_type} (fp32 absmax)",
            math.prod(shape),
            self.block_numel,
            4,
            self.companions(shape, dtype),
            shared_constants=(code,),
        )


@register_semantics("expert")
class Expert(BlockSemantics):
    """One expert of a stacked ``(E, ...)`` MoE weight is one unit (expert parallel placement).

    Compute unit: one expert; placement unit: 1 element. A tensor with this semantics is a stacked
    expert tensor, so per-expert semantics on it act on each expert (``semantics/_experts.py``).
    """

    min_ndim = 2

    def grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        if len(shape) < 2:
            raise self.error(
                tensor,
                shape,
                "a stacked expert weight has shape (num_experts, ...) with at least 2 dims",
                "apply 'expert' only to stacked expert weights (e.g. rule '*.experts.*=expert')",
            )
        return UnitGrid.units(math.prod(shape), math.prod(shape[1:]))

    def placement_grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        self.grid(shape, dtype, tensor=tensor)  # the same shape check
        return _fine(shape)
