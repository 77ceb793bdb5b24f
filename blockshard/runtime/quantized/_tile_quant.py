"""Tile quantizers of trainable weights gathered quantized: MX (1 x 32) and blockwise FP8 (B x B).

Each quantizes and dequantizes one *piece* of a tensor: elements ``[start, start + numel)`` of its
row-major flattening, cut at whole tiles (the float layout's units under the ``mx`` / ``mx:4`` /
``fp8_block:B`` semantics), so the piece's bytes are the whole tensor's bytes of those tiles
([Note: quantized gather] in _gather.py).

* ``mx`` / ``mx:4``: torchao's ``MXTensor.to_mx`` (MXFP8 e4m3 / MXFP4 e2m1, E8M0 scale per 32
  values along the last dim, torchao's default FLOOR scale rounding) and its ``to_dtype``
  dequantization. A piece of whole 32-value blocks is quantized as a ``[n, 32]`` tensor: every
  block's bytes are those of ``to_mx`` on the whole tensor (checked by the tests).
* ``fp8_block:B``: pure torch. One fp32 scale per ``B x B`` tile (edge tiles partial),
  ``scale = max(amax, 1e-12) / 448`` (torchao float8's amax clamp), payload
  ``(w / scale).to(float8_e4m3fn)`` (the cast saturates at +-448), dequantized as
  ``(q.float() * scale).to(dtype)``. A ``(E, rows, cols)`` weight is tiled per expert.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from blockshard._errors import QuantizedWeightError
from blockshard.runtime.quantized._tile_major import PackedTileOrder
from blockshard.semantics import BlockSemantics
from blockshard.semantics._quantizers import MX, FP8Block

__all__ = [
    "FP8_E4M3_MAX",
    "FP8BlockQuantizer",
    "MXQuantizer",
    "PackedFP8Quantizer",
    "TileQuantizer",
    "tile_quantizer",
]

FP8_E4M3_MAX = 448.0
_AMAX_EPS = 1e-12


def _error(fqn: str, what: str, fix: str) -> QuantizedWeightError:
    return QuantizedWeightError(f"quantized gather of {fqn!r}: {what}. Fix: {fix}")


@dataclass(frozen=True)
class TileQuantizer:
    """Quantizes pieces of one tensor of ``shape`` (row-major) into a uint8 payload and uint8 scales."""

    fqn: str
    shape: tuple[int, ...]

    @property
    def label(self) -> str:
        raise NotImplementedError

    @property
    def unit_numel(self) -> int:
        """The tile unit a piece must hold whole (a float layout cut falls only between them)."""
        raise NotImplementedError

    def full(self, payload: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole tensor's payload and scales (uint8, in tile order) in their own dtypes and shapes."""
        raise NotImplementedError

    def payload_bytes(self, start: int, numel: int) -> int:
        raise NotImplementedError

    def scale_bytes(self, start: int, numel: int) -> int:
        raise NotImplementedError

    def quantize(self, piece: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``piece`` [numel] (any float dtype) -> (payload uint8, scales uint8)."""
        raise NotImplementedError

    def dequantize(
        self, payload: torch.Tensor, scales: torch.Tensor, start: int, numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """The piece's values [numel] in ``dtype`` from its payload and scales (uint8)."""
        raise NotImplementedError

    def dequantize_into(
        self, weight: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor, start: int, numel: int
    ) -> None:
        """The piece dequantized at its places in ``weight`` (the whole tensor, 1-D row-major, in
        the dtype to compute in)."""
        weight[start : start + numel].copy_(self.dequantize(payload, scales, start, numel, weight.dtype))

    def assemble(self, pieces: list[tuple[int, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`full` of every piece's ``(start, payload, scales)``."""
        pieces = sorted(pieces, key=lambda x: x[0])
        return self.full(torch.cat([p[1] for p in pieces]), torch.cat([p[2] for p in pieces]))


@dataclass(frozen=True)
class MXQuantizer(TileQuantizer):
    bits: int = 8
    block: int = 32

    @property
    def label(self) -> str:
        return f"MX ({'MXFP4 e2m1' if self.bits == 4 else 'MXFP8 e4m3'}, 1 x {self.block})"

    @property
    def unit_numel(self) -> int:
        return self.block

    def full(self, payload: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        *lead, last = self.shape
        qdata = payload.view(*lead, last * self.bits // 8)
        return (qdata if self.bits == 4 else qdata.view(self.elem_dtype)), scales.view(torch.float8_e8m0fnu).view(
            *lead, last // self.block
        )

    @property
    def elem_dtype(self) -> torch.dtype:
        return torch.float4_e2m1fn_x2 if self.bits == 4 else torch.float8_e4m3fn

    def payload_bytes(self, start: int, numel: int) -> int:
        return numel * self.bits // 8

    def scale_bytes(self, start: int, numel: int) -> int:
        return numel // self.block

    def quantize(self, piece: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

        mx = MXTensor.to_mx(piece.reshape(-1, self.block), self.elem_dtype, block_size=self.block)
        return mx.qdata.view(torch.uint8).reshape(-1), mx.scale.view(torch.uint8).reshape(-1)

    def dequantize(
        self, payload: torch.Tensor, scales: torch.Tensor, start: int, numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        from torchao.prototype.mx_formats.mx_tensor import to_dtype

        per_block = self.block * self.bits // 8
        data = payload.view(-1, per_block)
        if self.bits == 8:
            data = data.view(self.elem_dtype)
        scale = scales.view(torch.float8_e8m0fnu).view(-1, 1)
        values: torch.Tensor = to_dtype(data, scale, self.elem_dtype, self.block, dtype)
        return values.reshape(-1)


@dataclass(frozen=True)
class FP8BlockQuantizer(TileQuantizer):
    tile: int = 128

    @property
    def label(self) -> str:
        return f"blockwise FP8 (e4m3fn, {self.tile} x {self.tile} tiles)"

    @property
    def unit_numel(self) -> int:
        *lead, rows, cols = self.shape
        return rows * cols if lead and rows % self.tile else self.tile * cols

    def full(self, payload: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        *lead, rows, cols = self.shape
        tiles = (-(-rows // self.tile), -(-cols // self.tile))
        return payload.view(torch.float8_e4m3fn).view(self.shape), scales.view(torch.float32).view(*lead, *tiles)

    def _matrices(self, start: int, numel: int) -> tuple[int, int, int]:
        """The piece as ``experts`` matrices of ``rows x cols`` (each tiled on its own)."""
        *lead, rows, cols = self.shape
        if lead and rows % self.tile:  # the unit is one expert: the piece holds whole experts
            return numel // (rows * cols), rows, cols
        return 1, numel // cols, cols  # whole stripes of tile rows (the tensor's last may be shorter)

    def payload_bytes(self, start: int, numel: int) -> int:
        return numel

    def scale_bytes(self, start: int, numel: int) -> int:
        experts, rows, cols = self._matrices(start, numel)
        return 4 * experts * -(-rows // self.tile) * -(-cols // self.tile)

    def _tiled(self, x: torch.Tensor, experts: int, rows: int, cols: int) -> torch.Tensor:
        """``x`` [experts * rows * cols] zero-padded to whole tiles: [experts, rb, B, cb, B]."""
        B = self.tile
        rb, cb = -(-rows // B), -(-cols // B)
        padded = x.new_zeros(experts, rb * B, cb * B)
        padded[:, :rows, :cols] = x.view(experts, rows, cols)
        return padded.view(experts, rb, B, cb, B)

    def quantize(self, piece: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        experts, rows, cols = self._matrices(start, piece.numel())
        tiles = self._tiled(piece.float(), experts, rows, cols)
        scale = tiles.abs().amax(dim=(2, 4)).clamp(min=_AMAX_EPS) / FP8_E4M3_MAX  # [experts, rb, cb], fp32
        q = (tiles / scale[:, :, None, :, None]).to(torch.float8_e4m3fn)
        q = q.view(experts, -1, q.shape[3] * q.shape[4])[:, :rows, :cols]
        return q.reshape(-1).view(torch.uint8), scale.reshape(-1).view(torch.uint8)

    def dequantize(
        self, payload: torch.Tensor, scales: torch.Tensor, start: int, numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        experts, rows, cols = self._matrices(start, numel)
        tiles = self._tiled(payload.view(torch.float8_e4m3fn).float(), experts, rows, cols)
        scale = scales.view(torch.float32).view(experts, tiles.shape[1], tiles.shape[3])
        values = (tiles * scale[:, :, None, :, None]).to(dtype)
        return values.view(experts, tiles.shape[1] * self.tile, -1)[:, :rows, :cols].reshape(-1)


@dataclass(frozen=True)
class PackedFP8Quantizer(FP8BlockQuantizer):
    """Blockwise FP8 of a master in packed tile order ([Note: packed tile order in the engine] in
    _gather.py): a piece is a run of whole slots, whose tiles are a run of the tile-major order,
    each quantized as :class:`FP8BlockQuantizer` quantizes it in the whole weight; the payload is
    the tiles' values box by box (``PackedTileOrder.to_boxes``), the scales one fp32 per tile in
    tile-major order (the whole weight's :meth:`assemble` puts them in the grid's)."""

    order: PackedTileOrder | None = None  # set always (a default only as the fields after defaults need one)

    def __post_init__(self) -> None:
        assert self.order is not None and self.order.tile == self.tile, (self.order, self.tile)

    @property
    def slots(self) -> PackedTileOrder:
        assert self.order is not None
        return self.order

    @property
    def label(self) -> str:
        return f"blockwise FP8 (e4m3fn, {self.tile} x {self.tile} tiles, packed tile order)"

    @property
    def unit_numel(self) -> int:
        return self.slots.unit_numel

    def _tiles(self, start: int, numel: int) -> tuple[int, int]:
        """The tiles (tile-major order) of the piece ``[start, start + numel)`` of the layout tensor."""
        return self.slots.tile_range(*self.slots.slots_of(start, start + numel))

    def payload_bytes(self, start: int, numel: int) -> int:
        return self.slots.real_numel(*self.slots.slots_of(start, start + numel))

    def scale_bytes(self, start: int, numel: int) -> int:
        t0, t1 = self._tiles(start, numel)
        return 4 * (t1 - t0)

    def _by_tile(self, values: torch.Tensor, t0: int, t1: int) -> Iterator[torch.Tensor]:
        """Views ``[tiles, values per tile]`` of tile-major ``values`` of tiles ``[t0, t1)``, one per part."""
        for r in self.slots.tiles.runs(t0, t1):
            yield values[r.at : r.at + (r.hi - r.lo) * r.part.unit_numel].view(r.hi - r.lo, -1)

    def quantize(self, piece: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        t0, t1 = self._tiles(start, piece.numel())
        values = self.slots.unpack(piece.float(), start // self.unit_numel)
        q = torch.empty(values.shape, dtype=torch.float8_e4m3fn, device=values.device)
        scales = []
        for x, out in zip(self._by_tile(values, t0, t1), self._by_tile(q, t0, t1), strict=True):
            scale = x.abs().amax(dim=1).clamp(min=_AMAX_EPS) / FP8_E4M3_MAX  # one per tile, fp32
            out.copy_((x / scale[:, None]).to(torch.float8_e4m3fn))
            scales.append(scale)
        scale = torch.cat(scales) if scales else values.new_empty(0)
        return self.slots.tiles.to_boxes(q.view(torch.uint8), t0, t1), scale.view(torch.uint8)

    def _values(
        self, payload: torch.Tensor, scales: torch.Tensor, t0: int, t1: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """The tiles ``[t0, t1)`` dequantized, tile-major (1-D, ``dtype``)."""
        q = self.slots.tiles.from_boxes(payload, t0, t1).view(torch.float8_e4m3fn)
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
        scale, at = scales.view(torch.float32), 0
        for x, y in zip(self._by_tile(q, t0, t1), self._by_tile(out, t0, t1), strict=True):
            y.copy_(x.float() * scale[at : at + x.shape[0], None])
            at += x.shape[0]
        return out

    def dequantize(
        self, payload: torch.Tensor, scales: torch.Tensor, start: int, numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """The run of slots (``B * B`` values each, zeros past the tiles) in ``dtype``."""
        first, stop = self.slots.slots_of(start, start + numel)
        return self.slots.pack(self._values(payload, scales, *self._tiles(start, numel), dtype), first, stop)

    def dequantize_into(
        self, weight: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor, start: int, numel: int
    ) -> None:
        t0, t1 = self._tiles(start, numel)
        self.slots.tiles.put(weight, self._values(payload, scales, t0, t1, weight.dtype), t0, t1)

    def assemble(self, pieces: list[tuple[int, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        pieces = sorted(pieces, key=lambda x: x[0])
        out = torch.zeros(math.prod(self.shape), dtype=torch.uint8, device=pieces[0][1].device)
        for start, payload, scales in pieces:  # one fp32 scale per tile of the piece, tile-major
            t0 = self.slots.tile_at(start // self.unit_numel)
            t1 = t0 + scales.numel() // 4
            self.slots.tiles.put(out, self.slots.tiles.from_boxes(payload, t0, t1), t0, t1)
        scales = self.slots.scales_in_grid(torch.cat([p[2] for p in pieces]).view(torch.float32))
        return self.full(out, scales.contiguous().view(torch.uint8))


def tile_quantizer(fqn: str, shape: tuple[int, ...], dtype: torch.dtype, sems: list[BlockSemantics]) -> TileQuantizer:
    """The quantizer of a trainable weight from its matched semantics (``mx``, ``mx:4``, ``fp8_block:B``)."""
    found = [s for s in sems if isinstance(s, (MX, FP8Block))]
    if not dtype.is_floating_point or dtype.itemsize == 1:
        raise _error(
            fqn,
            f"its dtype is {str(dtype).removeprefix('torch.')}; quantized gather quantizes floating-point master "
            "weights (fp32, bf16, fp16)",
            "leave it out of the quantized-gather semantics (a frozen float8 weight with its "
            "weight_scale_inv is sharded as bytes on its own)",
        )
    if not found:
        shown = [s.spec for s in sems] or ["elementwise"]
        raise _error(
            fqn,
            f"its semantics {shown} is not a tile quantizer; quantized gather supports 'mx', 'mx:4' and 'fp8_block:B'",
            "give it one of those semantics (e.g. semantics={'*_proj.weight': 'fp8_block:128'}), or leave it out",
        )
    sem = found[0]
    if isinstance(sem, MX):
        if not shape or shape[-1] % sem.block:
            raise _error(
                fqn,
                f"shape {shape}: the last dim is not a multiple of the MX block of {sem.block}",
                "MX-quantize only weights whose last dim is a multiple of 32",
            )
        _check_torchao(fqn)
        return MXQuantizer(fqn, shape, bits=sem.bits, block=sem.block)
    if len(shape) not in (2, 3) or math.prod(shape) == 0:
        raise _error(
            fqn,
            f"shape {shape}: blockwise FP8 tiles non-empty 2-D weights (or stacked (E, rows, cols) experts)",
            "apply fp8_block to 2-D weights only (e.g. rule '*_proj.weight=fp8_block:128')",
        )
    return FP8BlockQuantizer(fqn, shape, tile=sem.tile)


def _check_torchao(fqn: str) -> None:
    try:
        from torchao.prototype.mx_formats.mx_tensor import MXTensor  # noqa: F401
    except ImportError as e:
        raise _error(
            fqn, f"MX quantization uses torchao's MX formats, which do not import ({e})", "pip install torchao"
        ) from e
