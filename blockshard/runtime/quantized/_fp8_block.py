"""Blockwise FP8 frozen weights (DeepSeek-V3 style) as a :class:`QuantizedTensor`.

A module holding a float8 ``weight`` ``[N, K]`` and a fp32 ``weight_scale_inv``
``[ceil(N / Br), ceil(K / Bc)]`` (one scale per ``Br x Bc`` tile; transformers' ``FP8Linear`` and
its ``block_size`` attribute) is sharded by whole ``Br``-row tile stripes (one unit grid, see
[Note: quantized layout]): a unit is ``Br * K`` payload bytes and its row of ``ceil(K / Bc)``
scales (the last stripe may be shorter); with ``tile_placement=True`` by whole tiles ([Note: tile
placement in the engine] in ``_frozen.py``): a unit is one tile's payload and its scale, in
tile-major order. A stacked expert weight ``[E, N, K]`` with scales ``[E, ceil(N / Br), ceil(K /
Bc)]`` is tiled per expert: by stripes where ``N % Br == 0`` (else one expert per unit, as the
planner's ``fp8_block`` grid), by tiles with each expert's short edge tiles. Both parameters are
swapped for gathered ones in forward.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from blockshard._errors import QuantizedWeightError
from blockshard.runtime.core._param import ParamRef
from blockshard.runtime.quantized._layout import SectionShape
from blockshard.runtime.quantized._tensor import QuantizedTensor, StateEntry, byte_view
from blockshard.runtime.quantized._tile_major import TileOrder

__all__ = ["fp8_block_pair", "fp8_block_sections", "fp8_block_tensor"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_block_pair(module: nn.Module, ignored: set[int]) -> tuple[nn.Parameter, nn.Parameter, object] | None:
    """``(weight, weight_scale_inv, block_size)`` of a blockwise FP8 module, else None."""
    w, s = module._parameters.get("weight"), module._parameters.get("weight_scale_inv")
    if w is None or s is None or w.dtype not in FP8_DTYPES or id(w) in ignored:
        return None
    return w, s, getattr(module, "block_size", None)


def _error(fqn: str, what: str, fix: str) -> QuantizedWeightError:
    return QuantizedWeightError(f"quantized weight {fqn!r} (blockwise FP8): {what}. Fix: {fix}")


def _check(fqn: str, w: torch.Tensor, s: torch.Tensor, block: object) -> tuple[int, int]:
    if not (isinstance(block, (tuple, list)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise _error(
            fqn,
            f"its module's block_size={block!r} is not a tile (rows, cols); a per-tensor scale has no tiles to keep whole",
            "set block_size=(128, 128) for tile-wise scales, or keep the module out of sharding (ignored_params)",
        )
    if w.dim() not in (2, 3):
        raise _error(
            fqn,
            f"it has shape {tuple(w.shape)}: blockwise FP8 tiles a 2-D weight or a stacked (experts, rows, cols) one",
            "quantize 2-D weights (or stacked experts) only, or keep it out of sharding (ignored_params)",
        )
    if w.requires_grad:
        raise _error(
            fqn, "it requires grad; blockwise FP8 weights here are frozen", "freeze it (p.requires_grad_(False))"
        )
    *lead, N, K = w.shape
    br, bc = block
    want = (*lead, -(-N // br), -(-K // bc))
    if tuple(s.shape) != want or s.dtype != torch.float32:
        shown = " x ".join(map(str, w.shape))
        raise _error(
            fqn,
            f"its weight_scale_inv has shape {tuple(s.shape)} ({s.dtype}); {shown} in {br} x {bc} tiles needs {want} "
            "fp32 scales",
            "re-quantize the weight with its scales (one fp32 scale per tile)",
        )
    return br, want[-1]


def tile_sections(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[TileOrder, tuple[SectionShape, ...]]:
    """The tile order of a tile-placed ``shape`` weight in ``block`` tiles (a 3-D one: stacked
    experts, tiled per expert), and its sections: the payload (one byte per value) tile by tile,
    one fp32 scale per tile."""
    order = TileOrder(tuple(shape), (int(block[0]), int(block[1])), stacked=len(shape) == 3)
    runs = tuple((p.count, p.unit_numel) for p in order.parts)
    payload = SectionShape("weight", math.prod(shape), block[0] * block[1], runs)
    return order, (payload, SectionShape("weight_scale_inv", 4 * order.n_tiles, 4))


def fp8_block_sections(
    fqn: str, w: torch.Tensor, s: torch.Tensor, block: object, *, tile_placement: bool
) -> tuple[TileOrder | None, tuple[SectionShape, ...], int]:
    """``(tile order or None, sections, units)`` of a blockwise FP8 weight (validated, see ``_check``)
    placed by stripes or (``tile_placement``) by tiles: what the layout needs, no bytes copied."""
    br, k_tiles = _check(fqn, w, s, block)
    shape = tuple(w.shape)
    if tile_placement:
        tiles, sections = tile_sections(shape, block)  # type: ignore[arg-type]
        return tiles, sections, tiles.n_tiles
    # B-row stripes; a stacked expert weight whose rows are no multiple of B: one expert (as the
    # planner's fp8_block grid, semantics/_quantizers.py)
    *lead, N, K = shape
    rows = br if not lead or N % br == 0 else N
    per_unit = k_tiles * -(-rows // br)  # scale rows per unit: one per stripe, all of an expert's
    stripes = (
        SectionShape("weight", w.numel(), rows * K),
        SectionShape("weight_scale_inv", s.numel() * 4, per_unit * 4),
    )
    return None, stripes, math.prod(lead) * -(-N // rows)


def fp8_block_tensor(
    fqn: str,
    refs: list[ParamRef],
    w: nn.Parameter,
    scale: tuple[str, ParamRef, nn.Parameter],
    block: object,
    *,
    tile_placement: bool = False,
) -> QuantizedTensor:
    """The :class:`QuantizedTensor` of a blockwise FP8 weight and its scales (validated, see
    ``_check``), by stripes or (``tile_placement``) by tiles."""
    _, ref_s, s = scale
    names = (refs[0].attr if refs else "weight", ref_s.attr)
    entries = [StateEntry(n, k, t.dtype, tuple(t.shape)) for k, (n, t) in enumerate(zip(names, (w, s), strict=True))]
    tiles, sections, n_units = fp8_block_sections(fqn, w, s, block, tile_placement=tile_placement)
    if tiles is not None:
        sources = [tiles.take(byte_view(w.detach().contiguous()).view(w.shape), 0, n_units)]
        sources.append(tiles.take_scales(s.detach().contiguous().view(torch.int32), 0, n_units).view(torch.uint8))
    else:
        sources = [byte_view(t.detach().contiguous()) for t in (w, s)]
    gathered = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (w, s)]
    return QuantizedTensor(
        fqn=fqn,
        refs=refs,
        format=f"blockwise FP8 ({str(w.dtype).removeprefix('torch.')}, {block[0]} x {block[1]} tiles)",  # type: ignore[index]
        numel=w.numel(),
        n_units=n_units,
        sections=sections,
        sources=sources,
        gathered=gathered,
        targets=[byte_view(t) for t in gathered],
        unsharded=nn.Parameter(gathered[0], requires_grad=False),
        extra=[([ref_s], nn.Parameter(gathered[1], requires_grad=False))],
        entries=entries,
        tiles=tiles,
    )
