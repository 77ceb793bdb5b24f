"""A ZeRO-3 checkpoint of blockshard's owner-compute, rewritten for another world size.

[Note: ZeRO-3 resharding]
DeepSpeed 0.19.8 refuses to load a ZeRO-3 checkpoint at another data-parallel world size
(``engine._load_zero_checkpoint``: "Automatic adjustment of ZeRO's optimizer state partitioning
with a new world size is not currently supported"), and its universal checkpoints read one flat
optimizer state per sub-group, which owner-compute does not have. :func:`reshard_zero3_checkpoint`
rewrites the files offline, for ``W'`` ranks, so that ``engine.load_checkpoint`` at ``W'`` continues
the run exactly:

* **fp32 masters**: every parameter rebuilt whole from the ``W`` partitions
  (:func:`~integrations.deepspeed._dcp.read_zero3_weights`) and cut again into ``ceil(numel / W')``
  per rank, concatenated per sub-group as DeepSpeed lays them out.
* **optimizer state**: the saved plan names each run (parameter, ``[start, end)``, owner) and the
  block semantics it followed; the runs at ``W'`` come from the same :func:`plan_runs`. A new run's
  state is assembled from the old runs that overlap it: a tensor with one value per element (fp32
  moments, bitsandbytes' 8-bit codes, Muon's momentum) is cut and joined by element; one with one
  value per 256-element block (bitsandbytes' ``absmax``) by block, which is exact because every run
  starts on a multiple of 256 from its parameter's start (the 8-bit grids cut only there); a
  bitsandbytes code table (``qmap``) and scalars (``step``) are the same in every run of a parameter
  and are copied. torchao's 8-bit state (``OptimState8bit``) is rebuilt from its codes (by element)
  and scales (by its ``block_size``, where the ``ao8bit`` grids cut), with the same code table.
  BlockedShampoo's per-tile state (``blocks``: a list of tile dicts, row-major) is joined and cut by
  tile: its ``shampoo:D`` grids cut only at tile rows, so a run's tiles are a contiguous run of the
  parameter's. A run with the same elements as an old one takes its state as it is (only the
  owner moved). Anything else (torchao's packed 4-bit codes re-cut, a state the plan does not
  describe) raises :class:`CheckpointError` naming the parameter and key.
* **model files**: rank 0's copied for every new rank with ``dp_world_size = W'``.

The new plan is recorded in every optimizer file, so the load's plan check
(:data:`~integrations.deepspeed._stage3.OWNER_PLAN_KEY`) passes only at ``W'``.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from blockshard._errors import CheckpointError
from blockshard.optim._shampoo_codec import TileRows
from blockshard.semantics import UnitGrid, get_semantics

from ._dcp import _is_zero3, _load, _rank_files, _tag_dir, _z3_name, read_zero3_weights
from ._stage3 import OWNER_PLAN_KEY, Run, plan_runs

__all__ = ["reshard_zero3_checkpoint"]

_BLOCK = 256  # bitsandbytes' state block: absmax per block
_QUANT = "__bnb_optimizer_quant_state__"


def _fail(where: Path, what: str, fix: str) -> CheckpointError:
    return CheckpointError(f"ZeRO-3 checkpoint {where}: {what}. Fix: {fix}")


def _grid(label: str, shape: tuple[int, ...]) -> UnitGrid:
    return UnitGrid.whole(math.prod(shape)) if label == "whole" else get_semantics(label).grid(shape, "float32")


def reshard_zero3_checkpoint(
    checkpoint_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], world_size: int, tag: str | None = None
) -> Path:
    """Rewrite the ZeRO-3 save ``checkpoint_dir`` (tag ``tag``, default ``latest``), written by
    blockshard's owner-compute, for ``world_size`` ranks into ``out_dir`` (same tag, a ``latest``
    file): ``engine.load_checkpoint(out_dir)`` at ``world_size`` continues the run ([Note: ZeRO-3
    resharding]). Returns the new tag directory."""
    src = Path(checkpoint_dir)
    where = src if _is_zero3(src) else _tag_dir(src, tag)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise _fail(where, f"world_size={world_size!r}", "pass the number of ranks to load at, an integer >= 1")
    files = _rank_files(where)
    W = len(files)
    saved = [_load(f) for _, f in files]
    plan = saved[0]["optimizer_state_dict"].get(OWNER_PLAN_KEY)
    if plan is None or "semantics" not in plan:
        raise _fail(
            where,
            "no owner plan with its semantics (not saved by blockshard's ZeRO-3 owner-compute, or by an older version)",
            "reshard checkpoints of blockshard's ZeRO-3 hook with a non-element-wise optimizer",
        )
    if plan["world_size"] != W:
        raise _fail(
            where, f"the plan says W = {plan['world_size']}, the files are of {W} ranks", "copy every rank's file"
        )
    names = [p[0] for p in plan["params"]]
    shapes = [tuple(p[1]) for p in plan["params"]]
    old_runs = [[Run(a, b, o, ()) for a, b, o in p[2]] for p in plan["params"]]
    labels = list(plan["semantics"])
    new_runs, _ = plan_runs(shapes, [_grid(lbl, s) for lbl, s in zip(labels, shapes, strict=True)], world_size)
    new_plan = {
        "world_size": world_size,
        "params": [
            [n, list(s), [[r.start, r.end, r.owner] for r in rs]]
            for n, s, rs in zip(names, shapes, new_runs, strict=True)
        ],
        "semantics": labels,
    }
    # every old run's state, by (parameter, run index): DeepSpeed saved each rank's owned runs in plan order
    old_state: dict[tuple[int, int], dict[str, Any]] = {}
    groups_template = None
    for r, sd in enumerate(saved):
        inner = sd["optimizer_state_dict"]["optimizer_state_dict"]
        groups_template = groups_template or inner["param_groups"]
        owned = [(j, k) for j, rs in enumerate(old_runs) for k, run in enumerate(rs) if run.owner == r]
        order = [i for g in inner["param_groups"] for i in g["params"]]
        if len(order) != len(owned):
            raise _fail(
                where,
                f"rank {r}'s optimizer holds {len(order)} tensors, its plan {len(owned)} runs",
                "reshard an unmodified save",
            )
        for idx, key in zip(order, owned, strict=True):
            old_state[key] = inner["state"].get(idx, {})
    if groups_template is None or len(groups_template) != 1:
        raise _fail(
            where, "more than one optimizer param_group", "reshard saves of one param_group (not done for several)"
        )
    masters = read_zero3_weights(where)
    model0 = _load(where / _z3_name(0, "model"))
    out_tag = Path(out_dir) / where.name
    if out_tag.exists():
        shutil.rmtree(out_tag)
    out_tag.mkdir(parents=True)
    for r in range(world_size):
        state: dict[int, dict[str, Any]] = {}
        idx = 0
        for j, rs in enumerate(new_runs):
            for run in rs:
                if run.owner != r:
                    continue
                olds = [old_state[j, k] for k in range(len(old_runs[j]))]
                state[idx] = _assemble(where, names[j], run, old_runs[j], olds, shape=shapes[j], label=labels[j])
                idx += 1
        flat = []
        for shapes_i in model0["param_shapes"]:
            parts = []
            for name, shape in shapes_i.items():
                n = math.prod(shape)
                P = -(-n // world_size) if n else 0
                piece = masters[name].reshape(-1)[r * P : min((r + 1) * P, n)]
                parts += [piece, torch.zeros(P - piece.numel(), dtype=piece.dtype)]
            flat.append(torch.cat(parts) if parts else torch.empty(0))
        sd = dict(saved[0])
        osd = dict(sd["optimizer_state_dict"])
        osd["partition_count"] = world_size
        osd["fp32_flat_groups"] = flat
        osd[OWNER_PLAN_KEY] = new_plan
        osd["optimizer_state_dict"] = {
            "state": state,
            "param_groups": [{**groups_template[0], "params": list(range(idx))}],
        }
        sd["optimizer_state_dict"] = osd
        torch.save(sd, out_tag / _z3_name(r, "optim"))
        model = dict(model0)
        model["dp_world_size"] = world_size
        torch.save(model, out_tag / _z3_name(r, "model"))
    (Path(out_dir) / "latest").write_text(where.name)
    return out_tag


def _assemble(
    where: Path,
    name: str,
    run: Run,
    olds: list[Run],
    states: list[dict[str, Any]],
    *,
    shape: tuple[int, ...] = (),
    label: str = "",
) -> dict[str, Any]:
    """The state of ``run`` from the old runs ``olds`` of the same parameter (``states``); ``shape``
    and ``label``: the parameter's shape and semantics (what Shampoo's tiles are cut by)."""
    pieces = [(o, s) for o, s in zip(olds, states, strict=True) if o.start < run.end and run.start < o.end]
    if len(pieces) == 1 and (pieces[0][0].start, pieces[0][0].end) == (run.start, run.end):
        return pieces[0][1]  # the same elements: the same state, whatever it holds (only the owner moved)
    first = pieces[0][1]
    return _merge(where, name, run, pieces, first, (), _tiles(shape, label))


def _tiles(shape: tuple[int, ...], label: str) -> TileRows | None:
    """BlockedShampoo's tiles of a parameter of ``shape`` under semantics ``label`` (``shampoo:D``;
    None for any other semantics: its state is re-cut by element)."""
    name, _, arg = label.partition(":")
    return TileRows.of(shape, int(arg)) if name == "shampoo" and arg.isdigit() and shape else None


def _merge(
    where: Path,
    name: str,
    run: Run,
    pieces: list[tuple[Run, dict[str, Any]]],
    template: dict[str, Any],
    path: tuple[str, ...],
    tiles: TileRows | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in template.items():
        at = (*path, key)
        values = [_at(s, at) for _, s in pieces]
        if isinstance(value, dict):
            out[key] = _merge(where, name, run, pieces, value, at, tiles)
        elif key == "blocks" and tiles is not None and isinstance(value, list):
            out[key] = _cut_tiles(where, name, run, pieces, values, tiles)
        elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in _leaves(value)):
            raise _fail(
                where,
                f"parameter {name!r}: state {'.'.join(at)!r} is a {type(value).__name__} of tensors, which cannot "
                "be re-cut by element (per-tile state of an optimizer other than BlockedShampoo under its shampoo:D "
                "semantics)",
                "reshard fp32, bitsandbytes 8-bit, torchao 8-bit, Muon or BlockedShampoo state",
            )
        elif _is_8bit_subclass(value):  # torchao's OptimState8bit: codes by element, scale by its block
            out[key] = _cut_subclass(where, name, run, pieces, values, ".".join(at))
        elif not isinstance(value, torch.Tensor) or value.dim() == 0 or key.startswith("qmap"):
            if any(not _same(v, value) for v in values):
                raise _fail(
                    where,
                    f"parameter {name!r}: state {'.'.join(at)!r} differs between its runs",
                    "reshard an unmodified save",
                )
            out[key] = value
        else:
            out[key] = _cut(where, name, run, pieces, values, ".".join(at))
    return out


def _cut_tiles(
    where: Path, name: str, run: Run, pieces: list[tuple[Run, dict[str, Any]]], values: list[Any], tiles: TileRows
) -> list[dict[str, torch.Tensor]]:
    """BlockedShampoo's per-tile state of ``run`` from the old runs' (``values``, each a list of tile
    dicts, row-major over the old run's tile rows): every run starts at a tile row (``shampoo:D``
    grids cut only there), so the parameter's tiles are the old runs' lists in order, and the new
    run's are a contiguous slice of them."""
    by_index: dict[int, dict[str, torch.Tensor]] = {}
    for (o, _), blocks in zip(pieces, values, strict=True):
        first = tiles.first(o.start)
        if first is None or not isinstance(blocks, list) or len(blocks) != tiles.count(o.start, o.end):
            raise _fail(
                where,
                f"parameter {name!r}: state 'blocks' of the run [{o.start}, {o.end}) is not whole {tiles.d}-row "
                "Shampoo tiles",
                "reshard an unmodified save of BlockedShampoo stepped with its shampoo:D semantics",
            )
        by_index.update((first + i, b) for i, b in enumerate(blocks))
    start = tiles.first(run.start)
    if start is None:
        raise _fail(
            where,
            f"parameter {name!r}: the new run [{run.start}, {run.end}) does not start at a tile row",
            "reshard an unmodified save",
        )
    return [{k: t.clone() for k, t in by_index[start + i].items()} for i in range(tiles.count(run.start, run.end))]


def _is_8bit_subclass(value: Any) -> bool:
    """torchao's 8-bit state tensor (``OptimState8bit``): codes, one per element; a scale per
    ``block_size`` elements; the code table ``qmap``."""
    return isinstance(value, torch.Tensor) and type(value) is not torch.Tensor and hasattr(value, "codes")


def _cut_subclass(
    where: Path, name: str, run: Run, pieces: list[tuple[Run, dict[str, Any]]], values: list[Any], key: str
) -> torch.Tensor:
    """A torchao 8-bit state of ``run`` from the old runs' (``values``): the codes joined by element,
    the scales by block, the code table and signedness the same in every piece."""
    first = values[0]
    for v in values:
        if type(v) is not type(first) or not all(hasattr(v, a) for a in ("codes", "scale", "qmap", "signed")):
            raise _fail(
                where,
                f"parameter {name!r}: state {key!r} is a {type(v).__name__}, not torchao's 8-bit state",
                "reshard fp32, bitsandbytes 8-bit, torchao 8-bit or Muon state",
            )
        if v.signed != first.signed or not _same(v.qmap, first.qmap) or v.block_size != first.block_size:
            raise _fail(
                where, f"parameter {name!r}: state {key!r} differs between its runs", "reshard an unmodified save"
            )
    codes = _cut(where, name, run, pieces, [v.codes for v in values], f"{key}.codes")
    scale = _cut(where, name, run, pieces, [v.scale for v in values], f"{key}.scale", block=first.block_size)
    if codes.numel() != run.numel:  # the codes were not one per element (a packed 4-bit state)
        raise _fail(
            where,
            f"parameter {name!r}: state {key!r} does not hold one code per element",
            "reshard fp32, bitsandbytes 8-bit, torchao 8-bit or Muon state",
        )
    rebuilt: torch.Tensor = type(first)(codes, scale.reshape(-1), first.qmap.clone(), first.signed, first.dtype)
    return rebuilt


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _leaves(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    return [value]


def _at(state: dict[str, Any], path: tuple[str, ...]) -> Any:
    for k in path:
        state = state[k]
    return state


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)


def _cut(
    where: Path,
    name: str,
    run: Run,
    pieces: list[tuple[Run, dict[str, Any]]],
    values: list[torch.Tensor],
    key: str,
    block: int = _BLOCK,
) -> torch.Tensor:
    """Join ``values`` (one per old run) over ``run``'s elements (or ``block``-element blocks)."""
    if type(values[0]) is not torch.Tensor:
        raise _fail(
            where,
            f"parameter {name!r}: state {key!r} is a {type(values[0]).__name__}",
            "reshard fp32, bitsandbytes 8-bit, torchao 8-bit or Muon state",
        )
    per_element = all(v.numel() == o.numel for (o, _), v in zip(pieces, values, strict=True))
    per_block = all(v.numel() == -(-o.numel // block) for (o, _), v in zip(pieces, values, strict=True))
    parts = []
    if per_element:
        for (o, _), v in zip(pieces, values, strict=True):
            a, b = max(o.start, run.start), min(o.end, run.end)
            parts.append(v.reshape(-1)[a - o.start : b - o.start])
        return torch.cat(parts).reshape(run.shape).clone()
    if per_block and all(o.start % block == 0 for o, _ in pieces) and run.start % block == 0:
        for (o, _), v in zip(pieces, values, strict=True):
            a, b = max(o.start, run.start), min(o.end, run.end)
            parts.append(v.reshape(-1)[(a - o.start) // block : -(-(b - o.start) // block)])
        return torch.cat(parts).clone()
    raise _fail(
        where,
        f"parameter {name!r}: state {key!r} has {values[0].numel()} values for a run of {pieces[0][0].numel} elements "
        f"(neither one per element nor one per {block}-element block)",
        "reshard fp32, bitsandbytes 8-bit, torchao 8-bit, Muon or BlockedShampoo state",
    )
