"""Built-in quantizer semantics beside ``nf4`` (``_builtins.py``): the storage formats of frozen weights.

==============  ========================================  ===============================================
semantics       unit (compute = placement)                stored per unit ([Note: quantized storage])
==============  ========================================  ===============================================
nf4, fp4        one 64-value block                        32 B payload, 4 B fp32 absmax
nf4_nested,     256 blocks = 16384 values (the last may   8192 B payload, 256 B uint8 absmax, 4 B fp32
fp4_nested      be shorter)                               state2 absmax
ao_nf4          64 x 256 = 16384 values                   8192 B payload, 256 B int8 scalers, one factor
                                                          in the weight's dtype
mx, mx:4        1 x 32 along the last dim                 32 B (mx:4: 16 B) payload, 1 B E8M0 scale
fp8_block:B     B-row stripe of B x B tiles               B x cols B payload, 4 B per tile
==============  ========================================  ===============================================

Each fact is read from the library (bitsandbytes 0.50, torchao 0.18) and checked against the
engine's format adapters in ``tests/quantized/test_fast_units_match_semantics.py``.
"""

from __future__ import annotations

import math

from blockshard._arith import ceil_div
from blockshard._errors import SemanticsError
from blockshard.semantics._base import BlockSemantics, Companion, SemanticsKind
from blockshard.semantics._builtins import NF4, _positive
from blockshard.semantics._grid import UnitGrid
from blockshard.semantics._registry import register_semantics
from blockshard.semantics._spec import itemsize_of, normalize_dtype
from blockshard.semantics._storage import QuantizedStorage, storage_with_companions

__all__ = ["FP4", "MX", "AoNF4", "FP4Nested", "FP8Block", "NF4Nested"]


@register_semantics("fp4")
class FP4(NF4):
    """bitsandbytes FP4 (``Params4bit(quant_type="fp4")``): the units and bytes of ``nf4``, another code."""

    quant_type = "fp4"


@register_semantics("nf4_nested")
class NF4Nested(NF4):
    """bitsandbytes NF4 with nested statistics (``compress_statistics=True``, QLoRA's double quantization).

    The fp32 absmax of the 64-value blocks is quantized again to uint8 in nested blocks of 256
    absmax, each with one fp32 ``state2.absmax``; a shard boundary may not cut a nested block, so the
    unit is 64 x 256 = 16384 values, the tensor's last one shorter (bitsandbytes handles a partial
    nested block). Stored per unit: 8192 payload bytes, 256 uint8 absmax, 4 bytes of state2 absmax;
    once per group the 16-value code and the 256-value fp32 dynamic map, per tensor a 4-byte offset.
    """

    nested_block = 256

    def grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        blocks = self._blocks(shape, tensor)
        return UnitGrid.units(blocks * self.block_numel, self.block_numel * self.nested_block)

    def companions(self, shape: tuple[int, ...], dtype: str) -> tuple[Companion, ...]:
        blocks = math.prod(shape) // self.block_numel
        return (
            Companion(suffix="absmax", numel=blocks, dtype="uint8", per_unit=self.nested_block),
            Companion(suffix="state2.absmax", numel=ceil_div(blocks, self.nested_block), dtype="float32", per_unit=1),
        )

    def storage(self, shape: tuple[int, ...], dtype: str) -> QuantizedStorage:
        return storage_with_companions(
            f"bitsandbytes {self.quant_type} (nested absmax)",
            math.prod(shape),
            self.block_numel * self.nested_block,
            4,
            self.companions(shape, dtype),
            shared_constants=((f"bitsandbytes {self.quant_type} code", 16 * 4), ("bitsandbytes dynamic map", 256 * 4)),
            tensor_constant_bytes=4,  # the nested offset
        )


@register_semantics("fp4_nested")
class FP4Nested(NF4Nested):
    """bitsandbytes FP4 with nested statistics: the units and bytes of ``nf4_nested``, another code."""

    quant_type = "fp4"


@register_semantics("ao_nf4")
class AoNF4(BlockSemantics):
    """torchao ``NF4Tensor``: 64-value blocks whose scales are quantized again in blocks of 256.

    One super-block is 64 x 256 = 16384 values (its 256 int8 scales share one quantization
    factor), so the tensor must be a multiple of 16384 and is cut only between super-blocks.
    Facts (torchao 0.18, ``to_nf4``): ``quantized_scalers`` are int8, ``quantization_factor``
    and ``scaler_mean`` are in the weight's dtype (2 bytes for bf16), the 16-value ``nf4`` table
    too (once per group).
    """

    kind = SemanticsKind.QUANTIZER
    min_ndim = 2  # blanket rules quantize weights (Linear), not norms or biases
    block = 64
    scaler_block = 256

    def grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        numel = math.prod(shape)
        sb = self.block * self.scaler_block
        if numel % self.block:
            raise self.error(
                tensor,
                shape,
                f"numel {numel} is not a multiple of the torchao NF4 block of {self.block} values (nor of the "
                f"super-block {self.block} x {self.scaler_block} = {sb})",
                "NF4-quantize only tensors of whole 64-value blocks; leave this one unquantized (an "
                "'elementwise' rule for it)",
            )
        if numel % sb:
            raise self.error(
                tensor,
                shape,
                f"numel {numel} is not a multiple of the torchao NF4 super-block {self.block} x "
                f"{self.scaler_block} = {sb}: its {numel // self.block} blocks do not fill whole nested blocks of "
                f"{self.scaler_block} scalers",
                "use 'nf4' (bitsandbytes, 64-value blocks) or 'nf4_nested' (its last nested block may be shorter) "
                "for this tensor, or leave it unquantized",
            )
        return UnitGrid.units(numel, sb)

    def companions(self, shape: tuple[int, ...], dtype: str) -> tuple[Companion, ...]:
        numel = math.prod(shape)
        sb = self.block * self.scaler_block
        return (
            Companion(suffix="quantized_scalers", numel=numel // self.block, dtype="int8", per_unit=self.scaler_block),
            Companion(suffix="quantization_factor", numel=numel // sb, dtype=normalize_dtype(dtype), per_unit=1),
        )

    def storage(self, shape: tuple[int, ...], dtype: str) -> QuantizedStorage:
        size = itemsize_of(dtype)
        return storage_with_companions(
            "torchao NF4Tensor",
            math.prod(shape),
            self.block * self.scaler_block,
            4,
            self.companions(shape, dtype),
            shared_constants=((f"torchao nf4 table ({normalize_dtype(dtype)})", 16 * size),),
            tensor_constant_bytes=size,  # scaler_mean
        )


@register_semantics("mx")
class MX(BlockSemantics):
    """OCP Microscaling (MXFP8/MXFP6/MXFP4): 1 x 32 blocks along the last dim, one E8M0 scale each.

    ``mx`` (``mx:8``) stores one byte per value (MXFP8, or MXFP6 unpacked), ``mx:4`` two values
    per byte (MXFP4, torchao's packed ``float4_e2m1fn_x2``); the 1-byte scale per block either way.
    """

    kind = SemanticsKind.QUANTIZER
    min_ndim = 2  # blanket rules quantize weights (Linear), not norms or biases
    block = 32

    def __init__(self, bits: int = 8) -> None:
        super().__init__()
        if bits not in (4, 8):
            raise SemanticsError(
                f"semantics mx:{bits}: the argument is the payload's bits per value, 8 (MXFP8, MXFP6 unpacked) or "
                "4 (MXFP4 packed two per byte); write 'mx' or 'mx:4'"
            )
        self.bits = bits
        self.spec = "mx" if bits == 8 else f"mx:{bits}"

    def grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        last = shape[-1] if shape else 1
        if last % self.block:
            raise self.error(
                tensor,
                shape,
                f"the last dim {last} is not a multiple of the MX block of {self.block}",
                "MX-quantize only tensors whose last dim is a multiple of 32",
            )
        return UnitGrid.units(math.prod(shape), self.block)

    def companions(self, shape: tuple[int, ...], dtype: str) -> tuple[Companion, ...]:
        numel = math.prod(shape)
        return (Companion(suffix="scale", numel=numel // self.block, dtype="uint8", per_unit=1),)

    def storage(self, shape: tuple[int, ...], dtype: str) -> QuantizedStorage:
        fmt = f"MX ({'MXFP4' if self.bits == 4 else 'MXFP8'}, 1 x {self.block})"
        return storage_with_companions(fmt, math.prod(shape), self.block, self.bits, self.companions(shape, dtype))


@register_semantics("fp8_block")
class FP8Block(BlockSemantics):
    """Blockwise FP8 (DeepSeek-V3 style): ``B x B`` tiles with one fp32 scale each -> ``B``-row stripes.

    Edge tiles may be partial (the last stripe may be shorter). A stacked ``(E, rows, cols)``
    expert weight is tiled per expert: ``B``-row stripes when ``rows % B == 0``, else one expert.
    Compute and placement unit: a stripe (weights are quantized where they are stored).
    """

    kind = SemanticsKind.QUANTIZER
    min_ndim = 2
    per_expert = True

    def __init__(self, tile: int = 128) -> None:
        super().__init__()
        self.tile = _positive("fp8_block", tile)
        self.spec = f"fp8_block:{self.tile}"

    def grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        if len(shape) not in (2, 3):
            raise self.error(
                tensor,
                shape,
                f"blockwise FP8 tiles 2-D weights (or stacked (E, rows, cols) experts), this tensor has {len(shape)} dims",
                "apply fp8_block to 2-D weights only (e.g. rule '*_proj.weight=fp8_block:128')",
            )
        *lead, rows, cols = shape
        if lead and rows % self.tile:
            # each expert is tiled on its own; its last stripe is partial, so an expert is the unit
            return UnitGrid.units(math.prod(shape), rows * cols)
        return UnitGrid.units(math.prod(shape), self.tile * cols)

    def companions(self, shape: tuple[int, ...], dtype: str) -> tuple[Companion, ...]:
        *lead, rows, cols = shape
        t, experts = self.tile, math.prod(lead)
        per_stripe = ceil_div(cols, t)  # each stripe of t rows carries one scale per tile
        n_scales = experts * ceil_div(rows, t) * per_stripe
        per_unit = per_stripe if not lead or rows % t == 0 else ceil_div(rows, t) * per_stripe
        return (Companion(suffix="scale_inv", numel=n_scales, dtype="float32", per_unit=per_unit),)

    def storage(self, shape: tuple[int, ...], dtype: str) -> QuantizedStorage:
        unit = self.grid(shape, dtype).unit_numel
        fmt = f"blockwise FP8 ({self.tile} x {self.tile} tiles)"
        return storage_with_companions(fmt, math.prod(shape), unit, 8, self.companions(shape, dtype))
