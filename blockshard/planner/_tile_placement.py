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
the plan's, since the parts' units in order are the engine's tile runs. Trainable masters gathered
quantized (``quantized_gather=True``) are not cut into parts: they take the packed tile order
(:func:`packed_masters`, [Note: packed tile order] in ``semantics/_tiles.py``), which is what the
engine builds ([Note: packed tile order in the engine] in ``runtime/quantized/_gather.py``). For
float weights with ``fp8_block`` semantics that are neither frozen FP8 nor gathered quantized the
parts are a **what-if**: the engine keeps their stripes (``benchmarks/plan_quality.py`` reports
both placements). Only a weight whose only semantics is ``fp8_block:B`` is tile-placed (2-D, or a
stacked ``(E, rows, cols)`` expert tensor); any other keeps its grids. The baselines (FSDP2,
ZeRO) of a plan are computed on the original weights.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from blockshard.planner._items import PlanItem, group_items
from blockshard.planner._quantized import plan_quantized_group
from blockshard.semantics import Companion, SemanticsRules, TensorSpec, storage_with_companions
from blockshard.semantics._experts import is_stacked_experts
from blockshard.semantics._quantizers import FP8Block
from blockshard.semantics._tiles import PackedTiles, TilePart, tile_parts

__all__ = ["PackedRun", "auto_tile_placed", "packed_masters", "part_name", "tile_placed"]


def part_name(name: str, part: TilePart) -> str:
    return f"{name}[{part.name}]"


class PackedRun:
    """The tile quantizer of a trainable master in packed tile order ([Note: packed tile order] in
    ``semantics/_tiles.py``): a slot of ``B * B`` values of the layout is the unit, its payload only
    the tiles' values, one fp32 scale per tile."""

    def __init__(self, order: PackedTiles) -> None:
        self.order = order
        self.unit = order.unit_numel
        self.spec = f"fp8_block:{order.tile} packed tiles of {order.shape}"


def _fp8_tile(it: PlanItem, rules: SemanticsRules) -> int | None:
    """``B`` where ``it``'s only semantics is ``fp8_block:B`` on a non-empty 2-D weight or stacked
    ``(E, rows, cols)`` experts (what tile placement places), else None."""
    sems = rules.matching(it.spec)
    if len(sems) != 1 or not isinstance(sems[0], FP8Block) or len(it.spec.shape) not in (2, 3) or not it.numel:
        return None
    if len(it.spec.shape) == 3 and not is_stacked_experts(it.spec, sems):
        return None
    return sems[0].tile


def packed_masters(items: Iterable[PlanItem], semantics: object) -> tuple[list[PlanItem], dict[str, PackedTiles]]:
    """``items`` (trainable masters gathered quantized) with every weight whose only semantics is
    ``fp8_block:B`` in packed tile order: one flat tensor of ``n_slots * B * B`` values whose unit
    is one slot, its cost scaled by the zeros; and ``{name: its order}``. What
    ``fully_shard(..., quantized_gather=True, tile_placement=True)`` lays out ([Note: packed tile
    order in the engine] in ``runtime/quantized/_gather.py``)."""
    rules = SemanticsRules.coerce(semantics)
    out: list[PlanItem] = []
    orders: dict[str, PackedTiles] = {}
    for it in items:
        b = _fp8_tile(it, rules)
        if b is None:
            out.append(it)
            continue
        order = PackedTiles(tuple(it.spec.shape), b, stacked=len(it.spec.shape) == 3)
        spec = TensorSpec(
            name=it.name,
            shape=(order.numel,),
            dtype=it.spec.dtype,
            group=it.spec.group,
            module_type=it.spec.module_type,
            param_group=it.spec.param_group,
        )
        cost = it.cost * order.numel / it.numel
        out.append(PlanItem(spec, order.grid, cost, f"{it.label} (packed tiles)", None, it.storage))
        orders[it.name] = order
    return out, orders


def tile_placed(
    items: Iterable[PlanItem], semantics: object, tiles: Collection[str] = ()
) -> tuple[list[PlanItem], dict[str, PlanItem]]:
    """``items`` with every weight whose only semantics is ``fp8_block:B`` replaced by its parts,
    but those in ``tiles`` (gathered quantized: their masters take the packed tile order,
    :func:`packed_masters`); and ``{part name: the weight's item}``."""
    rules = SemanticsRules.coerce(semantics)
    out: list[PlanItem] = []
    originals: dict[str, PlanItem] = {}
    for it in items:
        b = None if it.name in tiles else _fp8_tile(it, rules)  # masters: in packed tile order (_qgather.py)
        if b is None:
            out.append(it)
            continue
        stacked = len(it.spec.shape) == 3
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
    return out, originals


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
        parted, originals = tile_placed(frozen, semantics)
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
