"""Plan quality: blockshard's layouts against FSDP2, ZeRO-3, ZeRO-1/2 and naive padding.

    python benchmarks/plan_quality.py --json --out docs/results/plan_quality.json

For every catalog model x W in {8, 64, 1024, 16384} x semantics: blockshard's padding and
``S / lower bound`` beside each baseline's padding and units split, and the collectives used
(buckets); the planning time of Llama-3-405B at W = 16384; planning time against the number
of tensors; and, per catalog model x semantics x W in {1024, 8192, 16384}, the time of the plan
``blockshard plan`` makes (the default policy, owner compute included; best of ``--speed-repeats``)
against ``SPEED_TARGET_SECONDS`` (issue 24). Targets (``FINE_TARGET_RATIO`` and ``FINE_TARGET_PADDING`` below; docs/planner.md,
"Targets, and where the units themselves forbid them") are checked and reported, not asserted:
fine units (every unit <= total / (8 W) in its group) at W <= 1024 should reach
``S / lower bound <= 1.02`` and padding <= 1%; coarse units should never pad more than the
block-respecting baseline ("naive").
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import statistics
import sys
import time

from _common import add_output_args, command  # benchmarks/_common.py (benchmarks/ is on sys.path)
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from blockshard import SemanticsError
from blockshard.planner import catalog_models, compare, model_tensors, plan_model
from blockshard.semantics import TensorSpec
from blockshard.semantics._tiles import PackedTiles

WORLD_SIZES = (8, 64, 1024, 16384)
TILE_WORLD_SIZES = (8, 64, 256, 1024)  # issue 24's targets for fp8_block:128 tile placement
TILE_SEMANTICS = "fp8_block:128"
SEMANTICS = ("elementwise", "bnb8bit", "nf4", "mx", "ao_nf4", "muon", "shampoo:1024", "fp8_block:128")
FINE_TARGET_RATIO, FINE_TARGET_PADDING = 1.02, 0.01
SPEED_WORLD_SIZES, SPEED_TARGET_SECONDS = (1024, 8192, 16384), 0.3


def _case(model: str, tensors: list[TensorSpec], W: int, sem: str) -> dict:
    try:
        plan = plan_model(tensors, W, semantics=sem, policy="whole")  # what fully_shard builds today
    except SemanticsError as exc:  # e.g. ao_nf4 on a model whose weights are no multiple of 16384
        return {"model": model, "world_size": W, "semantics": sem, "not_applicable": str(exc)}
    cmp = compare(plan)
    fine = all(g.largest_unit <= g.total_numel / (8 * W) for g in plan.groups)
    naive = cmp.baselines["naive"]
    row = {
        "model": model,
        "world_size": W,
        "semantics": sem,
        "fine_units": bool(fine),
        "padding_fraction": plan.padding_fraction,
        "max_segment_over_lower_bound": plan.max_segment_over_lower_bound,
        "num_collectives": sum(len(g.buckets) for g in plan.groups),
        "max_cost_over_mean": plan.max_cost_over_mean,
        "num_groups": len(plan.groups),
        "plan_seconds": plan.plan_seconds,
        "baselines": {
            k: {"padding_fraction": v.padding_fraction, "splits_units": v.splits_units}
            for k, v in cmp.baselines.items()
        },
    }
    if fine and W <= 1024:
        row["target_met"] = (
            plan.max_segment_over_lower_bound <= FINE_TARGET_RATIO and plan.padding_fraction <= FINE_TARGET_PADDING
        )
    elif not fine:
        row["target_met"] = plan.padding_fraction <= naive.padding_fraction + 1e-12
    return row


def _planning_time(repeats: int) -> dict:
    tensors = model_tensors("llama3-405b")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan_model(tensors, 16384, semantics="bnb8bit")
        times.append(time.perf_counter() - t0)
    return {"model": "llama3-405b", "world_size": 16384, "semantics": "bnb8bit", "num_tensors": len(tensors),
            "seconds_min": min(times), "seconds_median": statistics.median(times), "target_seconds": 0.3}  # fmt: skip


def _scaling(repeats: int) -> list[dict]:
    """Distinct layers (no two groups alike, so nothing is shared): time against tensors."""
    rows = []
    for layers in (32, 64, 128, 256, 512):
        tensors = []
        for i in range(layers):
            h = 1024 + 64 * i
            for name, shape in (("q", (h, h)), ("k", (h // 4, h)), ("v", (h // 4, h)), ("o", (h, h)),
                                ("up", (4 * h, h)), ("down", (h, 4 * h)), ("norm", (h,))):  # fmt: skip
                tensors.append(TensorSpec(name=f"layers.{i}.{name}", shape=shape, group=f"layers.{i}"))
        best = min(_timed(tensors) for _ in range(repeats))
        rows.append(
            {"num_tensors": len(tensors), "seconds": best, "microseconds_per_tensor": 1e6 * best / len(tensors)}
        )
    return rows


def _packed_tiles(model: str, tile: int = 128) -> float:
    """Elements of the model's 2-D and stacked 3-D weights in packed tile order over their own
    elements: what trainable masters hold under ``quantized_gather=True, tile_placement=True``
    ([Note: packed tile order]; docs/design.md, "Tile placement")."""
    real = packed = 0
    for t in model_tensors(model):
        if len(t.shape) not in (2, 3):
            continue
        real += math.prod(t.shape)
        packed += PackedTiles(tuple(t.shape), tile, stacked=len(t.shape) == 3).numel
    return packed / real if real else 1.0


def _tiles(models: list[str]) -> list[dict]:
    """fp8_block:128 by B-row stripes, by tiles (``tile_placement=True``, docs/design.md "Tile
    placement") and per group whichever pads less (``"auto"``): padding; frozen FP8, each rank's
    segment over its unpadded share of the payload + scales (what ``fully_shard(...,
    tile_placement=...)`` builds); gathered quantized (stripes and tiles), the bytes gathered per
    rank over the unpadded physical payload + scales and the masters held over their unpadded share
    (tiles: the masters in packed tile order, built)."""
    rows = []
    for model in models:
        tensors = model_tensors(model)
        for W in TILE_WORLD_SIZES:
            row: dict = {"model": model, "world_size": W, "semantics": TILE_SEMANTICS}
            for name, tiles in (("stripes", False), ("tiles", True), ("auto", "auto")):
                plan = plan_model(tensors, W, semantics=TILE_SEMANTICS, tile_placement=tiles)
                frozen = plan.quantized_totals()
                row[name] = {
                    "padding_fraction": plan.padding_fraction,
                    "plan_seconds": plan.plan_seconds,
                    "frozen_segment_over_share": frozen["segment_bytes_per_rank"] / frozen["rank_bytes_mean"],
                }
                if tiles == "auto":  # trainable masters keep their stripes under "auto"
                    continue
                q = plan_model(
                    tensors, W, semantics=TILE_SEMANTICS, quantized_gather=True, tile_placement=tiles
                ).quantized_gather_totals()
                row[name] |= {
                    "gathered_over_physical": q["gathered_over_physical"],
                    "gathered_bytes_per_step_per_rank": q["gathered_bytes_per_step_per_rank"],
                    "master_bytes_per_rank": q["master_bytes_per_rank"],
                    "masters_over_share": q["masters_over_share"],
                }
            rows.append(row)
    return rows


def _speed(models: list[str], repeats: int) -> dict:
    """The seconds of ``plan_model(tensors, W, semantics=sem)`` as ``blockshard plan`` runs it
    (default policy), best of ``repeats``, per model x semantics x W; the slowest and those over target."""
    rows = []
    for model in models:
        tensors = model_tensors(model)
        for sem in SEMANTICS:
            for W in SPEED_WORLD_SIZES:
                best, policy = math.inf, ""
                try:
                    for _ in range(repeats):
                        t0 = time.perf_counter()
                        plan = plan_model(tensors, W, semantics=sem)
                        best, policy = min(best, time.perf_counter() - t0), plan.policy
                except SemanticsError:
                    continue
                rows.append({"model": model, "semantics": sem, "world_size": W, "seconds": best, "policy": policy})
    rows.sort(key=lambda r: -r["seconds"])
    return {
        "target_seconds": SPEED_TARGET_SECONDS,
        "repeats": repeats,
        "cases": len(rows),
        "over_target": [r for r in rows if r["seconds"] > SPEED_TARGET_SECONDS],
        "slowest": rows[:10],
    }


def _timed(tensors: list[TensorSpec]) -> float:
    t0 = time.perf_counter()
    plan_model(tensors, 1024, semantics="bnb8bit")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(ap, timeout=None)  # --json, --out
    ap.add_argument("--models", nargs="*", default=None, help="catalog models (default: all)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--speed-repeats", type=int, default=3, help="best of this many per plan-speed case")
    ap.add_argument("--markdown", help="also write the summary tables as Markdown here (for docs/)")
    args = ap.parse_args(argv)
    console = Console(stderr=True)
    models = args.models or catalog_models()
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("planning", total=len(models) * len(WORLD_SIZES) * len(SEMANTICS))
        for model in models:
            tensors = model_tensors(model)
            for W in WORLD_SIZES:
                for sem in SEMANTICS:
                    progress.update(task, description=f"{model} W={W} {sem}")
                    rows.append(_case(model, tensors, W, sem))
                    progress.advance(task)
    result = {
        "command": command("plan_quality.py", argv if argv is not None else sys.argv[1:]),
        "machine": {"python": platform.python_version(), "processor": platform.machine(), "cpus": _cpus()},
        "cases": rows,
        "planning_time": _planning_time(args.repeats),
        "scaling": _scaling(args.repeats),
        "tile_placement": _tiles(models),
        "packed_tile_masters": {m: _packed_tiles(m) for m in models},
        "plan_speed": _speed(models, args.speed_repeats),
    }
    result["summary"] = _summary(rows)
    _print_summary(result, console)
    text = json.dumps(result, indent=1)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(text + "\n")
    if args.markdown:
        pathlib.Path(args.markdown).write_text(_markdown(result))
    if args.json:
        print(text)
    return 0


def _markdown(result: dict) -> str:
    """Per semantics and W: blockshard's worst padding and S / LB over the catalog, beside the baselines."""
    lines = [
        "| semantics | W | blockshard padding (worst model) | S / LB (worst) | collectives / group (max) "
        "| fsdp2 padding (units split) | zero3 | zero12 | naive padding |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for sem in SEMANTICS:
        for W in WORLD_SIZES:
            rs = [
                r for r in result["cases"] if r["semantics"] == sem and r["world_size"] == W and "padding_fraction" in r
            ]
            if not rs:
                continue
            worst = max(rs, key=lambda r: r["padding_fraction"])
            ratio = max(r["max_segment_over_lower_bound"] for r in rs)
            coll = max(r["num_collectives"] / r["num_groups"] for r in rs)
            b = {k: (max(r["baselines"][k]["padding_fraction"] for r in rs), sum(r["baselines"][k]["splits_units"] for r in rs)) for k in worst["baselines"]}  # fmt: skip
            cells = [f"{100 * b[k][0]:.2f}% ({b[k][1]:,})" for k in ("fsdp2", "zero3", "zero12")]
            lines.append(
                f"| {sem} | {W} | {100 * worst['padding_fraction']:.2f}% ({worst['model']}) | {ratio:.3f} | {coll:.2f} | "
                + " | ".join(cells)
                + f" | {100 * b['naive'][0]:.2f}% |"
            )
    t = result["planning_time"]
    lines += [
        "",
        f"Planning {t['model']} ({t['num_tensors']} tensors) at W = {t['world_size']} with {t['semantics']}: "
        f"{1e3 * t['seconds_min']:.1f} ms (min of runs; median {1e3 * t['seconds_median']:.1f} ms).",
        "",
        "| tensors (distinct layers) | plan time | per tensor |",
        "|---:|---:|---:|",
    ]
    lines += [
        f"| {r['num_tensors']} | {1e3 * r['seconds']:.1f} ms | {r['microseconds_per_tensor']:.1f} us |"
        for r in result["scaling"]
    ]
    s = result["summary"]
    lines += ["", f"Targets met in {s['target_met']} of {s['judged']} judged cases. Missed:", ""]
    lines += [
        f"- {m['model']} W={m['world_size']} {m['semantics']}: padding {100 * m['padding_fraction']:.2f}%, "
        f"S / LB {m['max_segment_over_lower_bound']:.4f}"
        for m in s["missed"]
    ]
    lines += [
        "",
        f'{TILE_SEMANTICS} by B-row stripes, by tiles (`tile_placement=True`, docs/design.md "Tile placement") '
        'and per group whichever pads less (`tile_placement="auto"`): padding; frozen FP8 weights (what '
        "`fully_shard(..., tile_placement=...)` builds), each rank's segment over its unpadded share of the "
        "payload + scales; with `quantized_gather=True` (trainable masters; by tiles in packed tile order) the "
        "bytes gathered per rank per step over the unpadded payload + scales, and the masters held per rank "
        "over their unpadded share.",
        "",
        "| model | W | stripes padding | tiles padding | frozen S / share: stripes | tiles | auto "
        "| gathered / physical: stripes | tiles | masters / share: stripes | tiles |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['model']} | {r['world_size']} | {100 * r['stripes']['padding_fraction']:.2f}% | "
        f"{100 * r['tiles']['padding_fraction']:.2f}% | {r['stripes']['frozen_segment_over_share']:.3f} | "
        f"{r['tiles']['frozen_segment_over_share']:.3f} | {r['auto']['frozen_segment_over_share']:.3f} | "
        f"{r['stripes']['gathered_over_physical']:.3f} | {r['tiles']['gathered_over_physical']:.3f} | "
        f"{r['stripes']['masters_over_share']:.3f} | {r['tiles']['masters_over_share']:.3f} |"
        for r in result.get("tile_placement", [])
    ]
    if packed := result.get("packed_tile_masters"):
        shown = ", ".join(f"{m} {x:.4f}" for m, x in packed.items())
        lines += ["", f"Masters in packed {TILE_SEMANTICS} tile order over their elements (docs/design.md): {shown}."]
    if speed := result.get("plan_speed"):
        lines += [
            "",
            f"Plan time as `blockshard plan` plans (default policy), best of {speed['repeats']}, over "
            f"{speed['cases']} cases (catalog x semantics x W in {list(SPEED_WORLD_SIZES)}): "
            f"{len(speed['over_target'])} over the {speed['target_seconds']} s target. The slowest:",
            "",
            "| model | semantics | W | policy | seconds |",
            "|---|---|---:|---|---:|",
        ]
        lines += [
            f"| {r['model']} | {r['semantics']} | {r['world_size']} | {r['policy']} | {r['seconds']:.3f} |"
            for r in speed["slowest"]
        ]
    return "\n".join(lines) + "\n"


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _summary(rows: list[dict]) -> dict:
    judged = [r for r in rows if "target_met" in r]
    return {
        "cases": len(rows),
        "not_applicable": [
            {k: r[k] for k in ("model", "world_size", "semantics", "not_applicable")}
            for r in rows
            if "not_applicable" in r
        ],
        "judged": len(judged),
        "target_met": sum(r["target_met"] for r in judged),
        "missed": [
            {k: r[k] for k in ("model", "world_size", "semantics", "padding_fraction", "max_segment_over_lower_bound")}
            for r in judged
            if not r["target_met"]
        ],
        "blockshard_splits_units": 0,
    }


def _print_summary(result: dict, console: Console) -> None:
    table = Table(title="padding: blockshard vs baselines (worst model per cell; units split by ZeRO-1/2)")
    table.add_column("semantics")
    for W in WORLD_SIZES:
        table.add_column(f"W={W}", justify="right")
    for sem in SEMANTICS:
        cells = []
        for W in WORLD_SIZES:
            rs = [
                r for r in result["cases"] if r["semantics"] == sem and r["world_size"] == W and "padding_fraction" in r
            ]
            if not rs:  # no model given applies this semantics at this W (--models)
                cells.append("n/a")
                continue
            worst = max(rs, key=lambda r: r["padding_fraction"])
            z = worst["baselines"]["zero12"]
            cells.append(
                f"{100 * worst['padding_fraction']:.2f}% vs naive {100 * worst['baselines']['naive']['padding_fraction']:.1f}% ({z['splits_units']} split)"
            )
        table.add_row(sem, *cells)
    console.print(table)
    t = result["planning_time"]
    console.print(
        f"llama3-405b at W=16384: {t['seconds_min'] * 1e3:.1f} ms (target {t['target_seconds'] * 1e3:.0f} ms)"
    )
    if speed := result.get("plan_speed"):
        worst = speed["slowest"][0] if speed["slowest"] else None
        console.print(
            f"plan speed: {len(speed['over_target'])} of {speed['cases']} cases over {speed['target_seconds']} s"
            + (
                f"; slowest {worst['model']} {worst['semantics']} W={worst['world_size']} {worst['seconds']:.3f} s"
                if worst
                else ""
            )
        )
    s = result["summary"]
    console.print(f"targets met in {s['target_met']} of {s['judged']} judged cases; missed: {len(s['missed'])}")
    tiles = Table(
        title=f"{TILE_SEMANTICS}: stripes vs tiles vs auto: padding, frozen S / share, gathered / physical, masters / share"
    )
    cols = (
        "model",
        "W",
        "stripes padding",
        "tiles padding",
        "S/share stripes",
        "tiles",
        "auto",
        "g/phys stripes",
        "tiles",
        "masters/share stripes",
        "tiles",
    )
    for col in cols:
        tiles.add_column(col, justify="left" if col == "model" else "right")
    for r in result["tile_placement"]:
        a, b, c = r["stripes"], r["tiles"], r["auto"]
        tiles.add_row(
            r["model"],
            str(r["world_size"]),
            f"{100 * a['padding_fraction']:.2f}%",
            f"{100 * b['padding_fraction']:.2f}%",
            *(f"{x['frozen_segment_over_share']:.3f}" for x in (a, b, c)),
            f"{a['gathered_over_physical']:.3f}",
            f"{b['gathered_over_physical']:.3f}",
            f"{a['masters_over_share']:.3f}",
            f"{b['masters_over_share']:.3f}",
        )
    console.print(tiles)


if __name__ == "__main__":
    sys.exit(main())
