"""``blockshard demo``: train a tiny Llama on W local gloo ranks and check it equals one process.

The demo (what ``make demo`` runs) does, in 10-40 s on 2 CPU cores (rank start-up dominates):

1. **Plan.** The layout blockshard uses for a tiny ``LlamaForCausalLM`` (config built in code, random
   init, no download) on W ranks, computed by the pure planner from shapes alone: per group the
   buckets, the segment ``S`` per rank, the padding, and the block shape every rank's optimizer sees
   for every parameter, and (policy ``auto``) the owner rank of every matrix a rank boundary cuts;
   then one line against FSDP2's ``Shard(0)`` for the same model.
2. **Train.** W spawned gloo ranks train it with ``blockshard.fully_shard`` (each decoder layer, then
   the root; policy ``auto``) and unmodified torch optimizers: ``torch.optim.Muon`` inside
   ``OwnerComputeOptimizer`` on the hidden matrices, AdamW on the rest. Every rank sees the whole
   batch, so the average of the gradients is exact at W in {2, 4} (see docs/design.md, "Sharding
   invariance"). Rank 0 streams each step's loss to the parent through a manager queue; the parent
   draws a progress bar with the latest loss.
3. **Check.** The same training in one process, then every parameter (``full_state_dict`` gathered
   on rank 0) against the single-process model: max |difference|, bitwise equality, PASS or FAIL.
   The ranks also report the layouts, owner plan and block shapes the engine really used, checked
   against (1).

Heavy imports (torch, transformers, rich) happen inside functions: ``import blockshard.cli`` stays light.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # annotations only: the heavy imports happen inside the functions
    from queue import Queue

    import torch
    from rich.console import Console
    from rich.progress import Progress, TaskID
    from rich.table import Table
    from torch import nn
    from torch.optim.optimizer import ParamsT

    from blockshard.planner import GroupLayout, ModelPlan

_T = TypeVar("_T")

__all__ = ["MODEL", "DemoRun", "run_demo"]

#: The tiny model: awkward shapes (257-token byte vocabulary, 777-wide MLP, 32-wide hidden), so
#: every shard boundary is ragged, and MLP matrices large against ``total / W``: at W = 2 and 4
#: ``policy="auto"`` computes them at owner ranks (whole placement would pad 20%) and keeps the
#: attention matrices whole.
MODEL: dict[str, int] = dict(
    vocab_size=257,
    hidden_size=32,
    intermediate_size=777,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
OPTIMIZERS = ("adamw", "muon")
#: World sizes where the average of W identical gradients is exact (docs/design.md, "Sharding invariance").
EXACT_WORLD_SIZES = (2, 4)
#: The demo spawns one gloo process per rank on this machine (``demo -W 1000`` spawned 194 before it was stopped).
MAX_DEMO_WORLD_SIZE = 8
MAX_DEMO_STEPS = 10_000
#: Elsewhere AdamW is compared within this (docs/design.md, "Sharding invariance").
ADAMW_TOLERANCE = 1e-5


@dataclass(frozen=True)
class DemoRun:
    """What every process trains (picklable: it travels to the spawned ranks)."""

    steps: int = 30
    semantics: str = "muon"
    optimizer: str = "muon"
    batch_size: int = 8
    seq_len: int = 64
    seed: int = 0
    lr: float = 3e-3
    muon_lr: float = 2e-2
    weight_decay: float = 0.1
    whole_matrices: bool = True  # the semantics' compute unit of every hidden matrix is the matrix


# -- what runs in the spawned processes ------------------------------------------------------
def _is_hidden_matrix(name: str) -> bool:
    return ".layers." in name and name.endswith("_proj.weight")


def _optimizers(model: nn.Module, run: DemoRun, world_size: int) -> list[torch.optim.Optimizer]:
    """AdamW on every local piece; with ``muon``, torch's Muon on the hidden matrices and AdamW on
    the rest, chosen by ``muon_param_groups`` (by name and global shape). Sharded, Muon runs inside
    ``OwnerComputeOptimizer``: unmodified, on whole matrices, at the owner of every matrix a rank
    boundary cuts. Under semantics whose compute unit is not the whole matrix
    (``--semantics elementwise``) the demo hands Muon the hidden matrices' pieces that are 2-D (a
    row stripe) and AdamW the flat runs: the control."""
    import torch

    from blockshard.optim import OwnerComputeOptimizer, muon_param_groups

    named = list(model.named_parameters())

    def adamw(params: ParamsT) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=run.lr, weight_decay=run.weight_decay)

    def muon(params: ParamsT) -> torch.optim.Optimizer:
        return torch.optim.Muon(params, lr=run.muon_lr, weight_decay=run.weight_decay)

    if run.optimizer == "adamw":
        return [adamw([p for _, p in named])]
    if not run.whole_matrices:  # the control: Muon on pieces of split matrices
        stripes = [p for n, p in named if _is_hidden_matrix(n) and p.ndim == 2]
        others = [p for n, p in named if not (_is_hidden_matrix(n) and p.ndim == 2)]
        return ([muon(stripes)] if stripes else []) + [adamw(others)]
    muon_group, rest = muon_param_groups(model)
    if world_size == 1:  # the reference: torch's Muon on one process
        return [muon([muon_group]), adamw([rest])]
    return [OwnerComputeOptimizer(muon, [muon_group]), adamw([rest])]


def _engine_hashes(model: nn.Module) -> dict[str, str]:
    """The hash of every group layout the engine built, renamed to full parameter names (as planned)."""
    from blockshard.runtime import group_layouts

    out: dict[str, str] = {}
    for prefix, lay in group_layouts(model).items():
        full = tuple(replace(t, name=f"{prefix}.{t.name}" if prefix else t.name) for t in lay.tensors)
        out[prefix] = replace(lay, name=prefix, tensors=full).layout_hash()
    return out


def _engine_owner_hash(model: nn.Module) -> str | None:
    """The hash of the owner plan the engine built (``None`` without owner-computed tensors)."""
    from blockshard.runtime import owner_plan

    return next((t.owner_hash for t in owner_plan(model).values() if t.units), None)


def _train(rank: int, world_size: int, run: DemoRun, queue: Queue[tuple[int, float]] | None) -> dict[str, Any]:
    """One process of the demo: W > 1 is a blockshard rank, W = 1 the single-process reference."""
    import logging

    for noisy in ("torchao", "torch.utils._pytree"):  # import-time warnings unrelated to the demo
        logging.getLogger(noisy).setLevel(logging.ERROR)
    from blockshard._tiny import text_batches, tiny_llama

    model = tiny_llama(run.seed, **MODEL)
    if world_size > 1:
        from blockshard.runtime import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, semantics=run.semantics)
        fully_shard(model, semantics=run.semantics)
    optimizers = _optimizers(model, run, world_size)
    losses = []
    batches = text_batches(run.steps, run.batch_size, run.seq_len, seed=run.seed)
    for step, (ids, labels) in enumerate(batches, 1):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
        if rank == 0 and queue is not None:
            queue.put((step, losses[-1]))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if world_size == 1:
        state, hashes = {n: p.detach().clone() for n, p in model.named_parameters()}, {}
    else:
        from blockshard.runtime import full_state_dict

        state, hashes = full_state_dict(model), _engine_hashes(model)  # a collective: every rank
        hashes["(owner plan)"] = _engine_owner_hash(model) or "none"
    return {"losses": losses, "shapes": shapes, "hashes": hashes, "state": state if rank == 0 else None}


# -- the parent: plan, progress, check --------------------------------------------------------
def _plan(world_size: int, semantics: str) -> ModelPlan:
    """The tiny model's plan from shapes alone (float32, one group per layer plus the root)."""
    from blockshard.planner import plan_model, tensors_from_hf_config

    config = {"model_type": "llama", "tie_word_embeddings": False, **MODEL}
    specs = [replace(s, dtype="float32") for s in tensors_from_hf_config(config)]
    return plan_model(specs, world_size, semantics=semantics)  # policy "auto", as fully_shard


def _planned_shapes(plan: ModelPlan) -> list[dict[str, tuple[int, ...]]]:
    """Per rank: the block shape of every parameter's local piece, as the engine will make it."""
    from blockshard.planner._units import block_shape

    out: list[dict[str, tuple[int, ...]]] = [{} for _ in range(plan.world_size)]
    for g in plan.groups:
        for r in range(plan.world_size):
            held = {p.index: p for p in g.pieces(r)}
            for i, t in enumerate(g.tensors):
                p = held.get(i)
                out[r][t.name] = block_shape(t.shape, p.start, p.numel) if p else (0,)
    return out


def _geometry(layout: GroupLayout) -> tuple[object, ...]:
    return layout.buckets, tuple((t.shape, t.offset, t.grid, t.bucket) for t in layout.tensors)


def _fmt_shape(shape: tuple[int, ...], full: tuple[int, ...]) -> str:
    if shape == (0,):
        return "[dim]·[/]"
    text = "×".join(str(d) for d in shape) if len(shape) > 1 else f"{shape[0]:,}"
    return f"[bold]{text}[/]" if shape == tuple(full) else text


def _plan_tables(plan: ModelPlan, per_rank: list[dict[str, tuple[int, ...]]]) -> list[tuple[str, Table]]:
    """(title, table) per distinct group layout (identical decoder layers share one)."""
    from rich.table import Table

    W = plan.world_size
    ranks = range(W) if W <= 8 else ()
    shown: list[tuple[GroupLayout, list[str]]] = []
    for g in sorted(plan.groups, key=lambda g: not g.name):  # layers first, the root last
        same = next((s for s in shown if _geometry(s[0]) == _geometry(g)), None)
        if same:
            same[1].append(g.name)
        else:
            shown.append((g, [g.name]))
    tables = []
    for g, names in shown:
        S = " + ".join(f"{b:,}" for b in g.buckets)
        title = f"[bold]{names[0] or 'root'}[/]: S = {S} per rank, padding {100 * g.padding_fraction:.2f}%"
        title += "".join(f" · [bold]{n}[/]: S = {S} per rank, the same layout" for n in names[1:])
        table = Table(header_style="bold", show_edge=False)
        table.add_column("tensor", overflow="fold")  # names fold on narrow terminals; numbers never do
        for col in ("shape", "unit", *(f"rank {r}" for r in ranks), *(() if ranks else ("ranks",))):
            table.add_column(col, no_wrap=True, justify="right")
        for t in g.tensors:
            name = (t.name[len(g.name) + 1 :] if g.name else t.name).removesuffix(".weight")
            unit = "whole" if t.grid.is_whole else f"{t.grid.unit_numel:,}"
            if t.name in plan.owner_tensors:
                unit += " (owner)"
            if ranks:
                cells = [_fmt_shape(per_rank[r][t.name], t.shape) for r in ranks]
            else:
                S_b = g.buckets[t.bucket]
                cells = [f"{t.offset // S_b}..{max(t.offset, t.end - 1) // S_b}"]
            table.add_row(name, "×".join(map(str, t.shape)), unit, *cells)
        tables.append((title, table))
    return tables


_LEGEND = (
    "[dim]S: elements per rank · unit: the smallest piece a shard may hold ((owner): computed whole at "
    "an owner rank where a boundary cuts it) · rank r: the block shape "
    "rank r's optimizer sees (bold: the whole tensor; a×b: whole rows; n: a flat run; ·: nothing) · "
    "tensor names without .weight[/]"
)


def _owner_lines(plan: ModelPlan) -> list[str]:
    """One line per owner-computed tensor: which ranks' boundary cuts it and which rank computes it."""
    from blockshard.planner._owner import unit_rows

    if plan.owners is None or not plan.owners.num_units:
        return ["policy auto: every hidden matrix whole on one rank (no owner-compute at this W)"]
    lines = [
        f"policy auto: {len(plan.owner_tensors)} matrices stored cut (unit 1), their cut matrices computed "
        "whole at an owner rank (OwnerComputeOptimizer: one all_to_all_single each way per step):"
    ]
    names = plan.owners.tensor_names
    for t, start, numel, owner in unit_rows(plan.owners):
        lines.append(
            f"  {names[t].removesuffix('.weight')}: elements {start:,}..{start + numel - 1:,} -> owner rank {owner}"
        )
    return lines


def _fsdp2_line(plan: ModelPlan) -> str:
    from blockshard.planner import compare

    f = compare(plan, baselines=("fsdp2",)).baselines["fsdp2"]
    cut = f"[red]{f.splits_units:,} units cut[/] by shard boundaries" if f.splits_units else "no unit cut"
    return (
        f"blockshard: padding {100 * plan.padding_fraction:.2f}%, no unit cut · FSDP2 Shard(0), same model: "
        f"padding {100 * f.padding_fraction:.2f}%, {cut}"
    )


def _launch(
    call: Callable[[], _T],
    progress: Progress,
    task: TaskID,
    queue: Queue[tuple[int, float]],
    steps: int,
    label: str,
) -> _T:
    """Run ``call`` in a thread while drawing rank 0's streamed losses; return its result."""
    import queue as queue_mod

    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = call()
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    while thread.is_alive() or not queue.empty():
        try:
            step, loss = queue.get(timeout=0.1)
        except queue_mod.Empty:
            continue
        progress.update(task, description=label, completed=step, loss=f"{loss:.4f}")
    thread.join()
    if "error" in box:
        raise box["error"]
    progress.update(task, completed=steps)
    result: _T = box["result"]
    return result


def _loss_table(sharded: list[float], single: list[float], W: int, rows: int = 10) -> Table:
    from rich.table import Table

    table = Table(
        title="loss per step",
        title_justify="left",
        header_style="bold",
        caption=f"rank 0 of W = {W} (red: not equal to one process)",
        caption_justify="left",
    )
    blocks = (len(sharded) + rows - 1) // rows
    for _ in range(blocks):
        table.add_column("step", justify="right", style="dim")
        table.add_column("loss", justify="right")
    for i in range(rows):
        cells = []
        for b in range(blocks):
            s = b * rows + i
            if s < len(sharded):
                style = "" if sharded[s] == single[s] else "red"
                cells += [str(s + 1), f"[{style}]{sharded[s]:.6f}[/]" if style else f"{sharded[s]:.6f}"]
            else:
                cells += ["", ""]
        if any(cells):
            table.add_row(*cells)
    return table


def _diff_table(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> Table:
    """Max |difference| per parameter, identical decoder layers folded into one row."""
    from rich.table import Table

    rows: dict[str, list[Any]] = {}  # [shape, count, max |diff|, bitwise]
    for name, want in ref.items():
        key = re.sub(r"\.\d+\.", ".*.", name)
        diff = (got[name] - want).abs().max().item() if want.numel() else 0.0
        row = rows.setdefault(key, [tuple(want.shape), 0, 0.0, True])
        row[1] += 1
        row[2] = max(row[2], diff)
        row[3] = row[3] and got[name].shape == want.shape and bool((got[name] == want).all())
    table = Table(
        title="parameters after training: W ranks (full_state_dict) vs one process",
        title_justify="left",
        header_style="bold",
    )
    for col in ("parameter", "shape", "count", "max |diff|", "bitwise"):
        if col == "parameter":
            table.add_column(col, overflow="fold")
        else:
            table.add_column(col, justify="right", no_wrap=True)
    for key, (shape, n, diff, equal) in rows.items():
        table.add_row(key, "×".join(map(str, shape)), str(n), f"{diff:.3g}", "[green]yes[/]" if equal else "[red]no[/]")
    return table


def run_demo(
    *,
    world_size: int = 2,
    steps: int = 30,
    semantics: str = "muon",
    optimizer: str = "muon",
    console: Console | None = None,
) -> int:
    """Plan, train on ``world_size`` gloo ranks and on one process, compare; 0 on PASS, 1 on FAIL.

    ``semantics`` is any ``--semantics`` spec (default ``muon``: every hidden matrix is computed
    whole, on the rank that holds it or at its owner). ``optimizer`` is ``adamw`` (torch AdamW on
    every local piece) or ``muon`` (torch Muon on hidden matrices, AdamW on the rest; bitwise only
    with ``muon`` semantics — any other semantics is the control that shows what splitting a
    matrix does).
    """
    from blockshard._errors import BlockshardError

    spawn = " (the demo spawns one process per rank on this machine)"
    for name, value, low, high, why, hint in (
        ("world_size", world_size, 2, MAX_DEMO_WORLD_SIZE, spawn, "; `blockshard plan` plans any world size"),
        ("steps", steps, 1, MAX_DEMO_STEPS, "", ""),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise BlockshardError(f"{name}={value!r} must be an integer >= {low}{why}")
        if value > high:
            raise BlockshardError(f"{name}={value!r} must be at most {high}{why}; pass {low} to {high}{hint}")
    if optimizer not in OPTIMIZERS:
        raise BlockshardError(f"optimizer={optimizer!r} must be one of {OPTIMIZERS}")
    import torch.multiprocessing as mp
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from blockshard._launch import run_single, spawn_gloo
    from blockshard._render import console as make_console

    out = console if console is not None else make_console()
    t0 = time.perf_counter()
    out.rule(f"blockshard demo: tiny Llama on {world_size} gloo ranks vs one process")
    plan = _plan(world_size, semantics)
    whole = all(it.grid.is_whole for it in plan.items if _is_hidden_matrix(it.name))
    run = DemoRun(steps=steps, semantics=semantics, optimizer=optimizer, whole_matrices=whole)
    opt_text = "torch.optim.AdamW" if optimizer == "adamw" else "torch.optim.Muon + AdamW"
    if optimizer == "muon" and whole:
        opt_text = "torch.optim.Muon in OwnerComputeOptimizer + AdamW"
    planned = _planned_shapes(plan)
    out.print(
        f"plan: tiny Llama, {plan.total_numel:,} float32 parameters on W = {world_size} ranks, "
        f"semantics [bold]{semantics}[/]"
    )
    for title, table in _plan_tables(plan, planned):
        out.print(title)
        out.print(table)
    out.print(_LEGEND)
    for line in _owner_lines(plan):
        out.print(line)
    out.print(_fsdp2_line(plan))
    exact = world_size in EXACT_WORLD_SIZES or optimizer != "adamw"
    if not exact:
        out.print(
            f"[yellow]note:[/] at W = {world_size} averaging float32 gradients is not exact: AdamW is "
            f"compared within {ADAMW_TOLERANCE:g} (bitwise at W = 2 and 4)"
        )
    out.print(
        f"\ntraining {steps} steps ({opt_text}, batch {run.batch_size}×{run.seq_len} bytes, every "
        "rank sees the whole batch)"
    )
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
    )
    try:
        with mp.get_context("spawn").Manager() as manager, Progress(*columns, console=out) as progress:
            queue = manager.Queue()
            task = progress.add_task(f"starting {world_size} ranks", total=steps, loss="-")
            ranks = _launch(
                lambda: spawn_gloo(_train, world_size, args=(run, queue), timeout=180),
                progress,
                task,
                queue,
                steps,
                f"blockshard, W = {world_size}",
            )
            task = progress.add_task("starting 1 process", total=steps, loss="-")
            single = _launch(
                lambda: run_single(_train, args=(run, queue), timeout=180),
                progress,
                task,
                queue,
                steps,
                "one process  ",
            )
    except (RuntimeError, TimeoutError) as exc:
        out.print(f"[bold red]FAIL[/]: a process failed:\n{exc}")
        return 1
    got, ref = ranks[0], single
    if got["state"].keys() != ref["state"].keys():
        out.print(f"[bold red]FAIL[/]: parameter names differ: {sorted(got['state'].keys() ^ ref['state'].keys())}")
        return 1
    out.print(_loss_table(got["losses"], ref["losses"], world_size))
    same_loss = got["losses"] == ref["losses"]
    out.print(f"loss at every step {'[green]identical to' if same_loss else '[red]differs from'}[/] one process")
    out.print(_diff_table(got["state"], ref["state"]))
    owner_hash = plan.owners.owner_hash() if plan.owners is not None and plan.owners.num_units else "none"
    want = {**{g.name: g.layout_hash() for g in plan.groups}, "(owner plan)": owner_hash}
    hashes_ok = all(r["hashes"] == want for r in ranks)
    shapes_ok = all(r["shapes"] == planned[rank] for rank, r in enumerate(ranks))
    for ok, what in (
        (hashes_ok, "every rank's engine built the planned layouts and owner plan (same hashes)"),
        (shapes_ok, "every rank's optimizer saw the planned block shapes"),
    ):
        out.print(f"{'[green]✓' if ok else '[red]✗'}[/] {what}")
    diff = max((got["state"][n] - p).abs().max().item() if p.numel() else 0.0 for n, p in ref["state"].items())
    bitwise = all(
        got["state"][n].shape == p.shape and bool((got["state"][n] == p).all()) for n, p in ref["state"].items()
    )
    close = bitwise or (not exact and diff <= ADAMW_TOLERANCE)
    passed = close and hashes_ok and shapes_ok
    verdict = "[bold green]PASS[/]" if passed else "[bold red]FAIL[/]"
    equal = f"all {len(ref['state'])} parameters bitwise equal" if bitwise else "parameters NOT bitwise equal"
    if not bitwise and close:
        equal = f"parameters within {ADAMW_TOLERANCE:g}, not bitwise equal"
    out.print(
        f"{verdict}: W = {world_size} ranks vs one process after {steps} steps: {equal} (max |difference| {diff:.3g})"
    )
    if not bitwise and optimizer == "muon" and semantics != "muon":
        out.print("(the control: Muon orthogonalized pieces of split matrices; --semantics muon keeps them whole)")
    out.print(f"[dim]wall time {time.perf_counter() - t0:.1f} s[/]")
    return 0 if passed else 1
