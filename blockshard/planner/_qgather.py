"""Trainable weights gathered quantized: the float masters' layout and the bytes the engine gathers, from shapes.

[Note: planned quantized gather]
``fully_shard(..., quantized_gather=True)`` ([Note: quantized gather] in
``runtime/quantized/_gather.py``) gives the floating-point parameters whose semantics is ``mx``,
``mx:4`` or ``fp8_block:B`` a buffer set of their own in the group, named ``<group>[quantized
gather]``: a float layout planned by those semantics (every rank's piece of each is whole tiles),
so the masters are *not* stored quantized and are not cut by the byte planner of frozen quantized
weights ([Note: planned quantized bytes]). ``plan_model(..., quantized_gather=True)`` (``blockshard
plan --quantized-gather``) plans the same: per group, those tensors leave the group's layout for a
layout of their own (the masters' persistent bytes: its ``S`` times the itemsize), and each rank's
quantized segment is, as the engine's ``plan_payload`` builds it, every piece's payload then its
scales (one E8M0 byte per 32 values; 4 bytes per FP8 tile), each section rounded up to 16 bytes;
``S_q`` is the largest rank's (at least 16). One unshard all-gathers ``W * S_q`` bytes instead of
the floats: forward, and again before the backward where the group reshards after forward (the
root once). The engine leaves these buffer sets out of its optimizer-cost balance (it rotates the
primary layout only), so the plan does too. ``tests/quantized/test_fast_plan_bytes.py`` checks the
layout and ``quantized_gather_stats`` against the engine's, exactly, at W = 1, 2, 3.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from blockshard._arith import ceil_div, round_up
from blockshard._errors import PlanError, QuantizedWeightError
from blockshard.planner._items import PlanItem
from blockshard.planner._layout import GroupLayout
from blockshard.planner._policy import choose_layout
from blockshard.planner._quantized import BF16_BYTES, byte_totals
from blockshard.planner._tile_placement import PackedRun, packed_masters
from blockshard.planner._units import Memo
from blockshard.semantics import SemanticsRules, TensorSpec
from blockshard.semantics._quantizers import MX, FP8Block

__all__ = [
    "QuantizedGatherBytes",
    "gather_buffers_name",
    "master_items",
    "plan_gather_buffers",
    "plan_quantized_gather",
    "quantized_gather_totals",
    "tile_semantics",
]

SECTION_ALIGN_BYTES = 16  # the engine's: every section of a quantized segment starts at a multiple of it
_MASTER_DTYPES = ("float64", "float32", "bfloat16", "float16")

# PackedRun: a master in packed tile order ([Note: packed tile order] in semantics/_tiles.py)
Tile: TypeAlias = MX | FP8Block | PackedRun


def gather_buffers_name(group: str) -> str:
    """The name of ``group``'s quantized-gather buffer set and its layout, as the engine names it."""
    return f"{group}[quantized gather]"


def tile_semantics(specs: Sequence[TensorSpec | PlanItem], semantics: object) -> dict[str, Tile]:
    """The tile quantizer of every tensor gathered quantized (its first ``mx`` / ``fp8_block`` match,
    as the engine's ``split_quantized_gather``); raises on input the engine refuses, or none at all."""
    rules = SemanticsRules.coerce(semantics)
    out: dict[str, Tile] = {}
    for spec in specs:
        if not isinstance(spec, TensorSpec):
            raise PlanError(
                "quantized_gather=True needs the tensors as TensorSpec (it reads their semantics), not "
                "PlanItem; pass the specs and semantics= to plan_model"
            )
        found = [s for s in rules.matching(spec) if isinstance(s, (MX, FP8Block))]
        if found:
            _check_master(spec, found[0])
            out[spec.name] = found[0]
    if not out:
        raise PlanError(
            "quantized gather (quantized_gather=True, blockshard plan --quantized-gather) gathers the weights "
            "whose semantics is a tile quantizer ('mx', 'mx:4' or 'fp8_block:B') quantized, but "
            f"semantics={_shown(semantics)} gives none of the model's {len(specs)} tensors one. Fix: add a rule "
            "such as '*_proj.weight=fp8_block:128' (or mx), or leave quantized gather off"
        )
    return out


def _shown(semantics: object) -> str:
    text = repr(semantics)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_master(spec: TensorSpec, tile: Tile) -> None:
    if spec.dtype not in _MASTER_DTYPES:
        raise QuantizedWeightError(
            f"quantized gather of {spec.name!r}: its dtype is {spec.dtype}; quantized gather quantizes "
            "floating-point master weights (fp32, bf16, fp16). Fix: leave it out of the quantized-gather "
            "semantics (a frozen float8 weight with its weight_scale_inv is sharded as bytes on its own)"
        )
    if isinstance(tile, FP8Block) and spec.numel == 0:
        raise QuantizedWeightError(
            f"quantized gather of {spec.name!r}: shape {spec.shape}: blockwise FP8 tiles non-empty 2-D weights "
            "(or stacked (E, rows, cols) experts). Fix: apply fp8_block to non-empty weights only"
        )


def _tile_unit(tile: Tile, shape: tuple[int, ...]) -> int:
    """The values a rank's piece must hold whole (the engine's ``TileQuantizer.unit_numel``)."""
    if isinstance(tile, MX):
        return tile.block
    if isinstance(tile, PackedRun):
        return tile.unit
    *lead, rows, cols = shape
    return rows * cols if lead and rows % tile.tile else tile.tile * cols


def _real_numel(tile: Tile, numel: int) -> int:
    """The weight's own values (a master in packed tile order holds the zeros of its slots too)."""
    return tile.order.real_numel() if isinstance(tile, PackedRun) else numel


def _piece_bytes(tile: Tile, shape: tuple[int, ...], start: int, numel: int) -> tuple[int, int]:
    """(payload, scales) bytes of the piece ``[start, start + numel)`` made of whole tiles."""
    if isinstance(tile, PackedRun):  # the payload of the run's real values only, one scale per tile
        first, stop = tile.order.slots_of(start, start + numel)
        t0, t1 = tile.order.tile_range(first, stop)
        return tile.order.real_numel(first, stop), 4 * (t1 - t0)
    if isinstance(tile, MX):
        return numel * tile.bits // 8, numel // tile.block
    *lead, rows, cols = shape
    experts, r = (numel // (rows * cols), rows) if lead and rows % tile.tile else (1, numel // cols)
    return numel, 4 * experts * ceil_div(r, tile.tile) * ceil_div(cols, tile.tile)


@dataclass(frozen=True)
class QuantizedGatherBytes:
    """One group's weights gathered quantized (see [Note: planned quantized gather]).

    ``layout`` lays out the float masters (``layout.segment_numel * layout.itemsize`` persistent
    bytes per rank); ``segment_bytes`` is every rank's quantized segment ``S_q``
    (``quantized_gather_stats(...).local_bytes``), ``rank_bytes`` the payload and scales each rank
    holds of it, ``gathered_bytes`` one unshard's all-gather output on every rank.
    """

    group: str  # the fully_shard group ("" for the root)
    layout: GroupLayout
    tensors: tuple[str, ...]
    numel: int  # the weights' own values (without the zeros of a packed tile order's slots)
    payload_bytes: int
    total_bytes: int  # payload and scales of every tensor
    segment_bytes: int
    rank_bytes: tuple[int, ...]
    gathers_per_step: int  # 2 where the group reshards after forward, 1 for the root

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def scale_bytes(self) -> int:
        return self.total_bytes - self.payload_bytes

    @property
    def master_bytes(self) -> int:
        """Persistent bytes of the float masters on every rank (``S`` elements of the layout)."""
        return self.layout.segment_numel * self.layout.itemsize

    @property
    def master_share_bytes(self) -> float:
        """The masters' unpadded share per rank: ``numel * itemsize / W``."""
        return self.numel * self.layout.itemsize / self.world_size

    @property
    def edge_padding_numel(self) -> int:
        """Elements the masters' layout holds beyond the weights' own (the zeros of packed tile order's slots)."""
        return self.layout.total_numel - self.numel

    @property
    def gathered_bytes(self) -> int:
        return self.world_size * self.segment_bytes

    @property
    def float_gathered_bytes(self) -> int:
        """One all-gather of the masters as floats (what ``quantized_gather=False`` moves)."""
        return self.world_size * self.master_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "layout": self.layout.name,
            "layout_hash": self.layout.layout_hash(),
            "tensors": list(self.tensors),
            "dtype": self.layout.dtype,
            "numel": self.numel,
            "payload_bytes": self.payload_bytes,
            "scale_bytes": self.scale_bytes,
            "total_bytes": self.total_bytes,
            "master_segment_numel": self.layout.segment_numel,
            "master_bytes": self.master_bytes,
            "master_share_bytes": self.master_share_bytes,
            "segment_bytes": self.segment_bytes,
            "rank_bytes": list(self.rank_bytes),
            "gathered_bytes": self.gathered_bytes,
            "float_gathered_bytes": self.float_gathered_bytes,
            "gathers_per_step": self.gathers_per_step,
        }


def plan_quantized_gather(
    group: str,
    layout: GroupLayout,
    items: Sequence[PlanItem],
    tiles: dict[str, Tile],
    *,
    gathers_per_step: int = 2,
    memo: Memo | None = None,
) -> QuantizedGatherBytes:
    """The quantized segments of ``layout`` (the masters of ``items``, in the group's order), as the
    engine's ``plan_payload`` builds them; raises where a piece cuts a tile. Identical groups share
    one computation through ``memo``."""
    shapes = {it.name: it.spec.shape for it in items}
    key = ("qgather", layout.buckets, tuple((t.offset, t.bucket, t.shape, tiles[t.name].spec) for t in layout.tensors))
    hit: tuple[tuple[int, ...], int] | None = memo.get(key) if memo is not None else None
    if hit is None:
        hit = _segments(group, layout, shapes, tiles)
        if memo is not None:
            memo[key] = hit
    rank_bytes, segment_bytes = hit
    return QuantizedGatherBytes(
        group=group,
        layout=layout,
        tensors=tuple(it.name for it in items),
        numel=sum(_real_numel(tiles[it.name], it.numel) for it in items),
        payload_bytes=sum(_piece_bytes(tiles[it.name], it.spec.shape, 0, it.numel)[0] for it in items),
        total_bytes=sum(rank_bytes),
        segment_bytes=segment_bytes,
        rank_bytes=rank_bytes,
        gathers_per_step=gathers_per_step,
    )


def _segments(
    group: str, layout: GroupLayout, shapes: dict[str, tuple[int, ...]], tiles: dict[str, Tile]
) -> tuple[tuple[int, ...], int]:
    """(payload and scale bytes every rank holds, ``S_q``): each piece's sections 16-byte aligned."""
    rank_bytes, sizes = [], []
    for r in range(layout.world_size):
        pos = held = 0
        for piece in layout.pieces(r):
            name = layout.tensors[piece.index].name
            tile, shape = tiles[name], shapes[name]
            _check_whole_tiles(group, r, name, shape, tile, piece.start, piece.numel)
            pb, sb = _piece_bytes(tile, shape, piece.start, piece.numel)
            pos += round_up(pb, SECTION_ALIGN_BYTES) + round_up(sb, SECTION_ALIGN_BYTES)
            held += pb + sb
        rank_bytes.append(held)
        sizes.append(pos)
    return tuple(rank_bytes), max(SECTION_ALIGN_BYTES, *sizes)


def _check_whole_tiles(
    group: str, rank: int, name: str, shape: tuple[int, ...], tile: Tile, start: int, numel: int
) -> None:
    unit, end = _tile_unit(tile, shape), start + numel
    if start % unit or (end % unit and end != math.prod(shape)):
        raise QuantizedWeightError(
            f"quantized gather of {name!r} (shape {shape}, {tile.spec}) in group {group!r}: rank {rank} holds "
            f"elements [{start}, {end}), which cut a tile of {unit} values, so its quantization would differ "
            "from the whole weight's. Fix: give it only its quantizer semantics (an optimizer's owner cut may "
            "not follow tiles), or policy='whole'"
        )


def master_items(
    items: list[PlanItem], tiles: dict[str, Tile], semantics: object, tile_placement: bool | str
) -> tuple[list[PlanItem], dict[str, Tile]]:
    """The masters of buffer set ``name`` (``items``, gathered quantized by ``tiles``) as they are
    laid out under ``tile_placement`` ([Note: packed tile order in the engine] in
    ``runtime/quantized/_gather.py``; ``fully_shard`` calls the same): ``True``, every weight
    whose only semantics is ``fp8_block:B`` in packed tile order; ``"auto"`` and ``False``,
    stripes (``"auto"`` chooses for frozen FP8 weights only). Returns the items and their
    quantizers."""
    if tile_placement is not True:
        return items, tiles
    padded, orders = packed_masters(items, semantics)
    return padded, tiles | {n: PackedRun(o) for n, o in orders.items()}


def plan_gather_buffers(
    gname: str,
    qitems: list[PlanItem],
    tiles: dict[str, Tile],
    world_size: int,
    policy: str,
    alignment_bytes: int,
    gathers: int,
    memo: Memo,
    *,
    semantics: object = None,
    tile_placement: bool | str = False,
) -> QuantizedGatherBytes:
    """The layout of group ``gname``'s quantized-gather buffer set (its weights gathered quantized,
    in packed tile order as :func:`master_items` chooses under ``tile_placement``) and their
    quantized segments (not rotated: the engine balances the primary layouts only)."""
    name = gather_buffers_name(gname)
    qitems, tiles = master_items(qitems, tiles, semantics, tile_placement)
    layout, owned, _ = choose_layout(qitems, world_size, policy, name=name, alignment_bytes=alignment_bytes, memo=memo)
    if owned:
        raise PlanError(
            f"group {name!r}: owner-computed tensors ({sorted(owned)[:3]}, policy={policy!r}) among the weights "
            "gathered quantized are not supported (fully_shard refuses them as well). Fix: pass policy='whole', "
            "or give those weights only their quantizer semantics"
        )
    return plan_quantized_gather(gname, layout, qitems, tiles, gathers_per_step=gathers, memo=memo)


def quantized_gather_totals(groups: Sequence[QuantizedGatherBytes], world_size: int) -> dict[str, int | float]:
    """Bytes of ``groups`` together: masters and quantized segments per rank, gathered per step, and
    what a float (the masters' dtype) or bf16 all-gather of the same weights moves.

    [Note: honest ratios] Every ratio names what it divides by. ``gathered_over_physical``: the
    bytes gathered per step over the weights' own payload and scales (unpadded) times the gathers
    per step: 1.0 means no padding moves. ``gathered_over_padded_float``: over gathering the float
    masters' *padded* layout (``W * S`` of the masters, which pads where tiles are coarse against
    ``total / W``, so it can read well while the quantized gather is mostly padding);
    ``gathered_over_bf16``: over the weights' unpadded bf16 bytes (2 per value) per gather.
    """
    out = byte_totals(groups, world_size)
    gathered = out["gathered_bytes_per_step_per_rank"]
    floats = sum(g.gathers_per_step * g.float_gathered_bytes for g in groups)
    bf16 = sum(g.gathers_per_step * BF16_BYTES * g.numel for g in groups)
    out["master_bytes_per_rank"] = sum(g.master_bytes for g in groups)
    share = sum(g.master_share_bytes for g in groups)  # unpadded: the masters' own values over W
    out["master_share_bytes_per_rank"] = share
    out["masters_over_share"] = out["master_bytes_per_rank"] / share if share else 0.0
    out["float_gathered_bytes_per_step_per_rank"] = floats  # padded: W * S of the masters' layout
    out["gathered_over_padded_float"] = gathered / floats if floats else 0.0
    out["bf16_gathered_bytes_per_step_per_rank"] = bf16  # unpadded: 2 bytes per value
    out["gathered_over_bf16"] = gathered / bf16 if bf16 else 0.0
    return out
