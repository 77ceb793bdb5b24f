"""Human output for the CLI: rich tables and a per-rank load plot."""

from __future__ import annotations

import os
from collections import Counter
from types import ModuleType
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from blockshard._errors import BlockshardError
from blockshard.planner import GroupLayout, ModelPlan
from blockshard.planner._baselines import BaselineResult
from blockshard.planner._compute import ComputeTally
from blockshard.planner._parallel import ParallelPlan
from blockshard.planner._report import Comparison

__all__ = [
    "check_plot_path",
    "comparison_table",
    "compute_table",
    "human",
    "layout_table",
    "plot_rank_loads",
    "policy_table",
    "quantized_gather_table",
    "quantized_table",
]


def human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def comparison_table(cmp: Comparison, title: str) -> Table:
    plan = cmp.plan
    names = list(cmp.baselines)
    table = Table(title=title, title_justify="left", header_style="bold")
    for col in ("group kind", "groups", "tensors", "collectives", "S / rank", "S / LB", "blockshard"):
        table.add_column(col, justify="right" if col != "group kind" else "left", no_wrap=True)
    for b in names:
        table.add_column(b, justify="right", no_wrap=True)
    for row in cmp.kinds:
        table.add_row(
            escape(row.kind),  # '[quantized gather]' is text, not markup
            str(row.num_groups),
            str(row.num_tensors),
            str(row.num_collectives),
            human(row.segment_numel),
            f"{row.segment_over_lower_bound:.4f}",
            _pct(row.padding_fraction),
            *(_base_cell(row.baselines[b]) for b in names),
        )
    table.add_section()
    table.add_row(
        "[bold]total[/]",
        str(len(plan.groups)),
        str(sum(len(g.tensors) for g in plan.groups)),
        str(sum(len(g.buckets) for g in plan.groups)),
        human(plan.segment_numel_per_rank),
        f"{plan.max_segment_over_lower_bound:.4f}",
        f"[bold]{_pct(plan.padding_fraction)}[/]",
        *(_base_cell(cmp.baselines[b]) for b in names),
    )
    table.caption = (
        f"{human(plan.total_numel)} parameters on W = {plan.world_size} ranks, planned in "
        f"{plan.plan_seconds * 1e3:.1f} ms. Cells: padding (units split by a shard boundary: wrong or lossy "
        "numerics). S / LB: segment over its lower bound. 'naive' pads every tensor to W x unit."
    )
    return table


def compute_table(cmp: Comparison) -> Table:
    """Per group kind and in total: the policy's price (padding, all_to_all) and the optimizer's load per rank."""
    plan = cmp.plan
    table = Table(title=f"optimizer step per rank · policy {plan.policy}", title_justify="left", header_style="bold")
    cols = ("group kind", "owner", "padding", "a2a max", "a2a mean", "state max", "state mean", "cost max",
            "cost LB", "max / LB")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right" if col != "group kind" else "left", no_wrap=True)
    for row in cmp.kinds:
        if row.compute is not None:
            table.add_row(escape(row.kind), *_compute_cells(row.compute, row.padding_fraction))
    table.add_section()
    table.add_row("[bold]total[/]", *_compute_cells(plan.compute, plan.padding_fraction))
    table.caption = (
        "owner: tensors under the owner policy. Bytes per rank per optimizer step. a2a (all_to_all): what a rank receives moving owner-computed units' gradient "
        "pieces to their owners and the new values back. state: parameters whose step a rank computes (one "
        "state tensor of the parameter dtype). cost: the semantics' cost (Newton-Schulz FLOPs for matrices); "
        "cost LB = max(mean, largest compute unit)."
    )
    return table


def _compute_cells(t: ComputeTally, padding: float) -> list[str]:
    return [
        f"{t.owner_tensors:,}",
        _pct(padding),
        human(float(t.all_to_all_bytes.max(initial=0))) + "B",
        human(float(t.all_to_all_bytes.mean())) + "B",
        human(float(t.state_bytes.max(initial=0))) + "B",
        human(float(t.state_bytes.mean())) + "B",
        f"{float(t.cost.max(initial=0)):.3g}",
        f"{t.cost_lower_bound:.3g}",
        f"{t.max_cost_over_lower_bound:.4f}",
    ]


def policy_table(plan: ModelPlan) -> Table:
    """The policy chosen per tensor kind (only tensors whose compute units are coarser than their placement)."""
    table = Table(title="policy per tensor kind", title_justify="left", header_style="bold")
    for col in ("tensor kind", "whole", "owner"):
        table.add_column(col, justify="right" if col != "tensor kind" else "left", no_wrap=True)
    for kind, counts in plan.policy_by_tensor_kind().items():
        table.add_row(kind, f"{counts['whole']:,}", f"{counts['owner']:,}")
    return table


def quantized_table(plan: ModelPlan) -> Table:
    """Per group kind and in total: the quantized weights' bytes per rank and all-gathered per step,
    beside a bf16 gather of the same weights ([Note: planned quantized bytes])."""
    title = "quantized weights per rank · payload and scales: the model's, the rest per rank"
    table = Table(title=title, title_justify="left", header_style="bold")
    cols = ("group kind", "groups", "tensors", "payload", "scales", "held max", "held mean", "S",
            "gather/step", "bf16/step", "g/bf16", "g/phys")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right" if col != "group kind" else "left", no_wrap=True, min_width=len(col))
    for kind, row in plan.quantized_by_kind().items():
        table.add_row(escape(kind), str(row["num_groups"]), *_quantized_cells(row))
    table.add_section()
    table.add_row("[bold]total[/]", str(len(plan.quantized_groups)), *_quantized_cells(plan.quantized_totals()))
    table.caption = (
        "Bytes of the quantized weights as fully_shard stores them: payload and scales (absmax, scalers, "
        "factors) of every group of the kind. held: what a rank holds (max and mean over ranks); S: its segment (held + padding: "
        "quantized_stats' local_bytes). gather/step: all-gather output per rank, forward and backward (the root "
        "once); bf16/step: the same weights in bf16, unpadded; g/bf16: gather over that; g/phys: "
        "gather over the payload and scales themselves (unpadded, the same gathers): 1.0 moves no padding. Code "
        "tables (replicated) are left out."
    )
    return table


def _quantized_cells(row: dict[str, Any]) -> list[str]:
    return [
        f"{row['num_tensors']:,}",
        human(row["payload_bytes"]) + "B",
        human(row["scale_bytes"]) + "B",
        human(row["rank_bytes_max"]) + "B",
        human(row["rank_bytes_mean"]) + "B",
        human(row["segment_bytes_per_rank"]) + "B",
        human(row["gathered_bytes_per_step_per_rank"]) + "B",
        human(row["bf16_gathered_bytes_per_step_per_rank"]) + "B",
        f"{row['gathered_over_bf16']:.4f}",
        f"{row['gathered_over_physical']:.4f}",
    ]


def quantized_gather_table(plan: ModelPlan) -> Table:
    """Per group kind and in total: the weights gathered quantized, their float masters per rank and
    the quantized bytes all-gathered per step, beside a float gather of the masters
    ([Note: planned quantized gather])."""
    title = "weights gathered quantized · float masters per rank, quantized tiles all-gathered"
    table = Table(title=title, title_justify="left", header_style="bold")
    cols = ("group kind", "groups", "tensors", "masters", "payload", "scales", "held max", "S_q",
            "gather/step", "f+pad/step", "g/f+pad", "g/phys")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right" if col != "group kind" else "left", no_wrap=True, min_width=len(col))
    for kind, row in plan.quantized_gather_by_kind().items():
        table.add_row(escape(kind), str(row["num_groups"]), *_gather_cells(row))
    table.add_section()
    table.add_row(
        "[bold]total[/]", str(len(plan.quantized_gather_groups)), *_gather_cells(plan.quantized_gather_totals())
    )
    table.caption = (
        "fully_shard(..., quantized_gather=True): masters: the float master pieces a rank keeps (its segment of "
        "the '\\[quantized gather]' layout, whole tiles on every rank; the optimizer table leaves them out, as "
        "the engine's cost balance does). payload and scales: of every weight of the "
        "kind. held: payload and scales a rank quantizes (max over ranks); S_q: its quantized segment "
        "(quantized_gather_stats' local_bytes). gather/step: all-gather output per rank, forward and backward "
        "(the root once); f+pad/step: the float masters' layout (its padding included) gathered as floats; "
        "g/f+pad: gather over that; g/phys: gather over the payload and scales themselves "
        "(unpadded, the same gathers): 1.0 moves no padding."
    )
    return table


def _gather_cells(row: dict[str, Any]) -> list[str]:
    return [
        f"{row['num_tensors']:,}",
        human(row["master_bytes_per_rank"]) + "B",
        human(row["payload_bytes"]) + "B",
        human(row["scale_bytes"]) + "B",
        human(row["rank_bytes_max"]) + "B",
        human(row["segment_bytes_per_rank"]) + "B",
        human(row["gathered_bytes_per_step_per_rank"]) + "B",
        human(row["float_gathered_bytes_per_step_per_rank"]) + "B",
        f"{row['gathered_over_padded_float']:.4f}",
        f"{row['gathered_over_physical']:.4f}",
    ]


def _base_cell(b: BaselineResult) -> str:
    split = f" ({b.splits_units:,})" if not b.block_respecting else ""
    style = "red" if b.splits_units else ""
    return f"[{style}]{_pct(b.padding_fraction)}{split}[/]" if style else f"{_pct(b.padding_fraction)}{split}"


def layout_table(layout: GroupLayout, rank: int | None = None) -> Table:
    S = layout.segment_numel
    buckets = " + ".join(f"{b:,}" for b in layout.buckets)
    title = (
        f"group {escape(layout.name) or '(root)'}: S = {buckets} elements per rank on W = {layout.world_size} "
        f"({len(layout.buckets)} collective{'s' if len(layout.buckets) > 1 else ''}), "
        f"padding {_pct(layout.padding_fraction)}, hash {layout.layout_hash()}"
    )
    table = Table(title=title, title_justify="left", header_style="bold")
    if rank is None:
        for col in ("tensor", "shape", "semantics", "bucket", "offset", "ranks", "unit"):
            table.add_column(col, justify="left" if col in ("tensor", "semantics") else "right")
        for t in layout.tensors:
            S_b = layout.buckets[t.bucket]
            r0, r1 = t.offset // S_b, max(t.offset, t.end - 1) // S_b
            unit = "whole" if t.grid.is_whole else f"{t.grid.unit_numel:,}"
            table.add_row(t.name, str(tuple(t.shape)), t.semantics, str(t.bucket), f"{t.offset:,}", f"{r0}..{r1}", unit)
        return table
    for col in ("tensor", "elements of tensor", "numel", "local offset"):
        table.add_column(col, justify="left" if col == "tensor" else "right")
    for p in layout.pieces(rank):
        t = layout.tensors[p.index]
        table.add_row(t.name, f"[{p.start:,}, {p.start + p.numel:,})", f"{p.numel:,}", f"{p.local_offset:,}")
    table.caption = f"rank {rank}: {layout.rank_numel(rank):,} of {S:,} elements hold data"
    return table


def _pieces_text(pieces: list[list[int]], most: int = 6) -> str:
    """``rank:start+numel`` of a tensor's pieces, the middle elided past ``most``."""
    text = [f"{r}:{a}+{n}" for r, a, n in pieces]
    if len(text) > most:
        text = [*text[: most // 2], f"... ({len(text)} pieces)", *text[-2:]]
    return " ".join(text)


def checkpoint_table(info: dict[str, Any]) -> Table:
    """What ``describe_checkpoint`` found in a DCP checkpoint directory."""
    status = "complete" if info["complete"] else "INCOMPLETE: " + "; ".join(info["problems"])
    saved = (
        f"saved by {info['saved_by']} {info['blockshard_version']} at world size {info['world_size']}"
        if info.get("world_size")
        else f"saved by {info.get('saved_by', 'dcp.save')}"
    )
    title = (
        f"checkpoint {info['path']}: {len(info['tensors'])} tensors, {info['tensor_bytes']:,} bytes of tensors "
        f"({info['file_bytes']:,} on disk), written by {info['ranks_that_wrote']} ranks, {saved}, {status}"
    )
    table = Table(title=title, title_justify="left", header_style="bold")
    for col in ("tensor", "global shape", "dtype", "bytes", "chunks", "semantics", "pieces (rank: start+numel)"):
        table.add_column(col, justify="left" if col in ("tensor", "dtype", "semantics") or "pieces" in col else "right")
    placed = {t["name"]: t for g in info.get("groups", []) for t in g["tensors"]}
    placed |= {  # quantized weights: every entry that holds a stream, with the tensor's format
        name: {"semantics": t["format"], "pieces": pieces}
        for g in info.get("quantized_groups", [])
        for t in g["tensors"]
        for name, pieces in t["entries"].items()
    }
    for t in info["tensors"]:
        where = placed.get(t["name"].removeprefix("model."))
        pieces = _pieces_text(where["pieces"]) if where else ""
        if where and isinstance(where.get("tp"), dict):  # a TP tensor: its TP-local tensor's pieces over dp
            tp = where["tp"]
            pieces = f"{tp['placement']} over tp {tp['degree']}, each {tuple(where['shape'])} over dp: {pieces}"
        sem = where["semantics"] if where else ""
        table.add_row(t["name"], str(tuple(t["shape"])), t["dtype"], f"{t['bytes']:,}", str(t["chunks"]), sem, pieces)
    lines = [
        f"group {g['module'] or '(root)'} ({g['class']}): world size {g['world_size']}, {g['dtype']}, segment "
        f"{g['segment_numel']:,} elements in {len(g['buckets'])} buckets, layout {g['layout_hash'][:12]}, semantics "
        + ", ".join(f"{k} x{v}" for k, v in g["semantics"].items())
        for g in info.get("groups", [])
    ]
    lines += [
        f"quantized group {g['module'] or '(root)'} ({g['class']}): world size {g['world_size']}, segment "
        f"{g['segment_bytes']:,} bytes, layout {g['layout_hash'][:12]}, "
        + ", ".join(f"{f} x{n}" for f, n in Counter(t["format"] for t in g["tensors"]).items())
        for g in info.get("quantized_groups", [])
    ]
    if info.get("optimizers"):
        lines.append(f"optimizers: {', '.join(info['optimizers'])}")
    if info["objects"]:
        lines.append(f"other entries (pickled): {', '.join(info['objects'])}")
    table.caption = "\n".join(lines) or None
    table.caption_justify = "left"
    return table


def _pyplot() -> ModuleType:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - matplotlib ships with the [plot] extra
        raise BlockshardError("--plot needs matplotlib: pip install 'blockshard[plot]'") from exc
    return plt


def check_plot_path(path: str) -> None:
    """Raise :class:`BlockshardError` unless ``path`` can take the plot (checked before planning)."""
    from matplotlib.figure import Figure

    _pyplot()
    formats = sorted(Figure().canvas.get_supported_filetypes())
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix not in formats:
        raise BlockshardError(
            f"--plot {path!r} has suffix {suffix or '(none)'!r}, not an image format matplotlib writes; "
            f"name the file with one of: {', '.join('.' + f for f in formats)} (e.g. loads.png)"
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        what = "is a file, not a folder" if os.path.exists(folder) else "does not exist"
        raise BlockshardError(
            f"--plot {path!r}: its folder {folder!r} {what}; create the folder or pass a path in an existing one"
        )
    if os.path.isdir(path):
        raise BlockshardError(
            f"--plot {path!r} is a folder; pass a file name such as {os.path.join(path, 'loads.png')!r}"
        )


def plot_rank_loads(cmp: Comparison, path: str, title: str) -> None:
    """Real elements per rank (blockshard) against each rank's segment and the baselines' shards."""
    plt = _pyplot()
    plan = cmp.plan
    loads = plan.rank_loads()
    ranks = range(plan.world_size)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    if plan.world_size <= 128:
        ax.bar(ranks, loads, width=0.9, label="blockshard: parameters held", color="#3b7dd8")
    else:
        ax.fill_between(ranks, loads, step="mid", alpha=0.6, label="blockshard: parameters held", color="#3b7dd8")
    ax.axhline(plan.segment_numel_per_rank, color="#3b7dd8", ls="--", label="blockshard: segment (held + padding)")
    colors = {"fsdp2": "#d62728", "zero3": "#ff7f0e", "zero12": "#2ca02c", "naive": "#7f7f7f"}
    for name, b in cmp.baselines.items():
        ax.axhline(b.per_rank_numel, color=colors.get(name, "k"), ls=":", label=f"{name}: shard per rank")
    ax.set_xlabel("rank")
    ax.set_ylabel("elements per rank (all groups)")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:  # e.g. no permission to write there
        raise BlockshardError(f"--plot {path!r} cannot be written ({exc}); pass a path you can write") from None
    finally:
        plt.close(fig)


def console(stderr: bool = False) -> Console:
    c = Console(stderr=stderr)
    if not c.is_terminal:  # pipes and logs: wide enough for the comparison table
        c = Console(stderr=stderr, width=140)
    return c


def parallel_tables(plan: ParallelPlan, title: str) -> list[Table]:
    """``blockshard plan --tp N --ep M``: the mesh and bytes per rank; the units the TP plan splits."""
    full, mean = plan.rank_bytes()
    ideal = plan.total_numel * plan.itemsize / plan.world_size
    mesh = f"dp {plan.dp} x tp {plan.tp} x ep {plan.ep} = {plan.world_size:,} ranks"
    table = Table(title=f"{title} · {mesh}", title_justify="left", header_style="bold")
    table.add_column("what", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    axes = Counter(p.axis or "replicated" for p in plan.placements)
    table.add_row("tensors sharded over tp / ep / replicated", f"{axes['tp']} / {axes['ep']} / {axes['replicated']}")
    table.add_row("parameter bytes, fullest rank", f"{human(full)}B")
    table.add_row("  mean over ranks / total / W", f"{human(mean)}B / {human(ideal)}B")
    table.add_row("  fullest / (total / W)", f"{full / ideal:.4f}" if ideal else "-")
    table.add_row("padding of the data-parallel plans", _pct(plan.padding_fraction()))
    kinds = Counter(s.kind for s in plan.split)
    table.add_row("units split by the TP plan (optimizer / quantizer)", f"{kinds['optimizer']} / {kinds['quantizer']}")
    table.add_row("owner-compute across tp, bytes per step (all ranks)", f"{human(plan.owner_bytes_total)}B")
    table.add_row("  busiest rank", f"{human(plan.owner_bytes_max_rank)}B")
    out = [table]
    if plan.split:
        split = Table(title="units the TP plan splits", title_justify="left", header_style="bold")
        for col in ("semantics", "placement", "kind", "tensors", "for example", "fix"):
            split.add_column(col, overflow="fold", justify="right" if col == "tensors" else "left")
        rows: dict[tuple[str, str, str, str], list[str]] = {}
        for s in plan.split:
            rows.setdefault((s.label, s.placement, s.kind, s.fix), []).append(s.name)
        for (label, placement, kind, fix), names in rows.items():
            split.add_row(label, placement, kind, str(len(names)), escape(names[0]), escape(fix))
        out.append(split)
    return out
