"""``plan_model(..., tile_placement=True)``: blockwise-FP8 weights planned in tile-major parts.

[Note: planned tile placement]
Under ``fp8_block:B`` a weight's placement unit is a ``B``-row stripe ([Note: tile-major order] in
``semantics/_tiles.py`` says why that pads at large ``W``). With ``tile_placement=True`` the
planner lays such a weight out as its tile-major parts instead: each part (``<name>[tiles]``,
``[right]``, ``[bottom]``, ``[corner]``) is a flat tensor of the group whose unit is one tile, so a
rank boundary may fall between any two tiles. Its cost is the weight's, split over the parts by
elements; its stored bytes (frozen FP8) the payload plus one fp32 scale per tile; gathered quantized
(``quantized_gather=True``), every rank quantizes whole tiles of its parts.

For **frozen FP8 weights** this is what ``fully_shard(..., tile_placement=True)`` builds ([Note:
tile placement in the engine] in ``runtime/quantized/_frozen.py``): the bytes each rank holds are
the plan's, since the parts' units in order are the engine's tile runs. For trainable weights
(``quantized_gather=True``, and float masters with ``fp8_block`` semantics) it is still a
**what-if**: the engine keeps their stripes, and ``blockshard plan --tile-placement`` reports the
padding and bytes the design would reach beside the stripes' (``benchmarks/plan_quality.py``
reports both). Only a weight whose only semantics is ``fp8_block:B`` is tile-placed (2-D, or a
stacked ``(E, rows, cols)`` expert tensor); any other keeps its grids. The baselines (FSDP2,
ZeRO) of a plan are computed on the original weights.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import TypeVar

from blockshard.planner._items import PlanItem, group_items
from blockshard.planner._quantized import plan_quantized_group
from blockshard.semantics import Companion, SemanticsRules, TensorSpec, storage_with_companions
from blockshard.semantics._experts import is_stacked_experts
from blockshard.semantics._quantizers import FP8Block
from blockshard.semantics._tiles import TilePart, tile_parts

__all__ = ["TileRun", "auto_tile_placed", "part_name", "tile_placed"]

_T = TypeVar("_T")


def part_name(name: str, part: TilePart) -> str:
    return f"{name}[{part.name}]"


class TileRun:
    """The tile quantizer of one part of a tile-placed weight: tiles of ``unit`` values, one fp32
    scale each (what ``_qgather`` asks of a tile semantics)."""

    def __init__(self, tile: int, part: TilePart) -> None:
        self.unit = part.unit_numel
        self.spec = f"fp8_block:{tile} {part.name} tiles"


def tile_placed(
    items: Iterable[PlanItem], semantics: object, tiles: Mapping[str, _T]
) -> tuple[list[PlanItem], dict[str, PlanItem], dict[str, _T | TileRun]]:
    """``items`` with every weight whose only semantics is ``fp8_block:B`` replaced by its parts;
    ``{part name: the weight's item}``; ``tiles`` (the quantized-gather quantizers by name) for the
    parts."""
    rules = SemanticsRules.coerce(semantics)
    out: list[PlanItem] = []
    originals: dict[str, PlanItem] = {}
    new_tiles: dict[str, _T | TileRun] = dict(tiles)
    for it in items:
        sems = rules.matching(it.spec)
        if len(sems) != 1 or not isinstance(sems[0], FP8Block) or len(it.spec.shape) not in (2, 3) or not it.numel:
            out.append(it)
            continue
        stacked = len(it.spec.shape) == 3
        if stacked and not is_stacked_experts(it.spec, sems):
            out.append(it)
            continue
        b = sems[0].tile
        gathered = new_tiles.pop(it.name, None) is not None
        for p in tile_parts(it.spec.shape, b, stacked=stacked):
            name = part_name(it.name, p)
            spec = TensorSpec(
                name=name,
                shape=(p.numel,),
                dtype=it.spec.dtype,
                group=it.spec.group,
                module_type=it.spec.module_type,
                param_group=it.spec.param_group,
            )
            storage = None
            if it.storage is not None:
                scales = (Companion(suffix="scale_inv", numel=p.count, dtype="float32", per_unit=1),)
                storage = storage_with_companions(
                    f"blockwise FP8 ({b} x {b} tiles, tile-major)", p.numel, p.unit_numel, 8, scales
                )
            out.append(
                PlanItem(spec, p.grid, it.cost * p.numel / it.numel, f"{it.label} ({p.name} tiles)", None, storage)
            )
            originals[name] = it
            if gathered:
                new_tiles[name] = TileRun(b, p)
    return out, originals, new_tiles


def auto_tile_placed(
    items: list[PlanItem], semantics: object, gathered: Collection[str], world_size: int, alignment_bytes: int
) -> tuple[list[PlanItem], dict[str, PlanItem]]:
    """``plan_model(..., tile_placement="auto")``, as ``fully_shard(..., tile_placement="auto")``
    builds: per group, its frozen blockwise-FP8 weights (those with quantized storage, not in
    ``gathered``: the quantized gather's) in tile-major parts where that gives the group's frozen
    quantized bytes a smaller segment than stripes (ties: stripes); trainable weights keep their
    stripes. Returns the items and ``{part name: weight's item}``."""
    chosen: dict[str, list[PlanItem]] = {}  # weight name -> its parts, in the groups that take tiles
    parts_of: dict[str, PlanItem] = {}
    for gname, gitems in group_items(items).items():
        frozen = [it for it in gitems if it.storage is not None and it.name not in gathered]
        parted, originals, _ = tile_placed(frozen, semantics, {})
        if not originals:
            continue

        def segment(group: list[PlanItem], name: str = gname) -> int:
            stored = [(it.name, it.storage) for it in group if it.storage is not None]
            return plan_quantized_group(name, stored, world_size, alignment_bytes).segment_bytes

        if segment(parted) < segment(frozen):
            for part in parted:
                if part.name in originals:
                    chosen.setdefault(originals[part.name].name, []).append(part)
            parts_of |= originals
    return [x for it in items for x in chosen.get(it.name, [it])], parts_of
