"""A :class:`Report` on the terminal (rich tables) and as a picture (matplotlib: bytes held per rank)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from blockshard._errors import ReportError

if TYPE_CHECKING:
    from blockshard.runtime._report._model import Report

__all__ = ["plot", "render"]


def _b(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _n(n: int | None) -> str:
    return "unknown" if n is None else f"{n:,}"


def tables(rep: Report) -> list[Any]:
    """The report's rich tables: groups, parameters, optimizers (and what no optimizer steps)."""
    from rich.markup import escape
    from rich.table import Table

    W = rep.world_size
    g = Table(title=f"groups · engine {rep.engine} · W = {W}", title_justify="left", header_style="bold")
    for col in ("group", "how", "dtype", "params", "total", "total / W", "held max", "held / (total/W)", "padding"):
        g.add_column(col, justify="left" if col in ("group", "how", "dtype") else "right", no_wrap=True)
    for row in rep.groups:
        g.add_row(
            escape(row.name or "<root>"),
            escape(row.how),
            row.dtype,
            str(row.num_params),
            _b(row.total_bytes),
            _b(row.total_bytes / row.world_size),
            _b(max(row.held_bytes, default=0)),
            f"{row.held_max_over_ideal:.4f}",
            f"{_b(row.padding_bytes)} ({100 * row.padding_fraction:.2f}%)",
        )
    g.add_section()
    held = rep.held_bytes
    g.add_row(
        "[bold]model[/]", "", "", str(len(rep.params)), _b(rep.total_bytes), _b(rep.total_bytes / W),
        _b(max(held, default=0)), f"{rep.held_max_over_ideal:.4f}", "",
    )  # fmt: skip
    g.caption = (
        "total: unpadded bytes of the parameters; held: a rank's buffer (padding included; replicated parameters "
        "whole on the model row); held / (total/W): the largest rank's over the unpadded bytes split evenly."
    )
    p = Table(title="parameters", title_justify="left", header_style="bold")
    for col in ("parameter", "shape", "group", "semantics", "unit", "compute unit", "policy", "owners",
                "held per rank", "padding after", "note / why replicated"):  # fmt: skip
        p.add_column(
            col,
            justify="left",
            overflow="fold",
            no_wrap=col == "parameter",
            min_width=12 if col.startswith("note") else None,
        )
    for prow in rep.params:
        p.add_row(
            escape(prow.name),
            "x".join(map(str, prow.shape)) or "()",
            escape(prow.group or "<root>") if prow.sharded else "[bold]replicated[/]",
            escape(prow.semantics or ("-" if not prow.sharded else "unknown")),
            _n(prow.placement_unit_numel) if prow.sharded else "-",
            _n(prow.compute_unit_numel) if prow.sharded else "-",
            prow.policy or "-",
            ",".join(map(str, prow.owner_ranks)) or "-",
            " / ".join(_b(b) for b in prow.held_bytes) if prow.sharded else f"{_b(prow.total_bytes)} on every rank",
            _b(prow.padding_bytes) if prow.sharded else "-",
            escape(prow.note),
        )
    p.caption = (
        "unit: the placement unit (elements a shard boundary may not cut); compute unit: what one optimizer call "
        "sees whole; owners: the ranks computing its cut compute units (policy owner); padding after: the hole the "
        "layout leaves after it."
    )
    out: list[Any] = [g, p]
    for opt in rep.optimizers:
        o = Table(title=f"optimizer {opt.index}: {opt.name}", title_justify="left", header_style="bold")
        for col in ("parameter", "state", "dtype", "kind", "as on one process", "bytes per rank"):
            o.add_column(col, justify="left", overflow="fold")
        for s in opt.states:
            check = {True: "yes", False: "[bold red]no[/]", None: "not checked"}[s.as_one_process]
            o.add_row(escape(s.param), escape(s.key), s.dtype, s.kind, check, " / ".join(_b(b) for b in s.bytes))
        o.caption = f"steps {len(opt.steps)} parameters" + (f"; {opt.note}" if opt.note else "")
        out.append(o)
    if rep.optimizers_given:
        n = Table(title="trainable parameters no optimizer steps", title_justify="left", header_style="bold")
        n.add_column("parameter")
        for name in rep.not_stepped:
            n.add_row(f"[bold red]{escape(name)}[/]")
        if not rep.not_stepped:
            n.add_row("none")
        out.append(n)
    return out


def render(rep: Report, console: Any = None) -> None:
    """Print the report's tables on ``console`` (a ``rich.console.Console``; default: stdout)."""
    from rich.console import Console

    console = console or Console()
    for t in tables(rep):
        console.print(t)


def plot(rep: Report, path: str | os.PathLike[str]) -> None:
    """Write a bar chart of the bytes each rank holds (padding and replicated parameters apart) and
    the ``total / W`` line (unpadded bytes split evenly) to ``path`` (PNG, SVG, PDF by its suffix)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ReportError(f"plot({str(path)!r}) needs matplotlib ({e}); pip install matplotlib") from None
    W = rep.world_size
    data = [sum(g.data_bytes[r] for g in rep.groups) for r in range(W)]
    pad = [sum(g.held_bytes[r] - g.data_bytes[r] for g in rep.groups) for r in range(W)]
    rep_bytes = [sum(p.total_bytes for p in rep.replicated)] * W
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * W + 2), 3.5))
    ranks = list(range(W))
    ax.bar(ranks, data, label="sharded (data)")
    ax.bar(ranks, pad, bottom=data, label="padding")
    ax.bar(ranks, rep_bytes, bottom=[d + q for d, q in zip(data, pad, strict=True)], label="replicated")
    ax.axhline(rep.total_bytes / W, color="black", linestyle="--", label="total / W (unpadded)")
    ax.set_xlabel("rank")
    ax.set_ylabel("bytes held")
    ax.set_title(f"bytes held per rank · {rep.engine} · W = {W}")
    ax.set_xticks(ranks)
    ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(os.fspath(path))
    except (OSError, ValueError) as e:
        raise ReportError(
            f"plot could not write {str(path)!r}: {e}. Fix: pass a writable path ending in .png"
        ) from None
    finally:
        plt.close(fig)
