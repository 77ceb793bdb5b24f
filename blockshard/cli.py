"""``blockshard`` command line: ``plan``, ``inspect``, ``report``, ``demo``, ``accelerate-config``,
``deepspeed-to-dcp`` and ``deepspeed-reshard``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from blockshard._errors import BlockshardError, PlanError

if TYPE_CHECKING:
    from blockshard.planner import ModelPlan


__all__ = ["main"]


def _add_model_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("--model", help="a catalog model (see `blockshard plan --list-models`)")
    src.add_argument("--config", help="a Hugging Face config.json (no weights needed)")
    src.add_argument("--shapes", help='a JSON tensor list {"tensors": [{"name", "shape", "dtype", "group"}]}')
    src.add_argument("--list-models", action="store_true", help="print the catalog and exit")
    p.add_argument("--world-size", "-W", type=int, default=8, help="number of ranks (default 8)")
    p.add_argument(
        "--semantics",
        default="elementwise",
        help="a built-in (nf4, bnb8bit, shampoo:1024, fp8_block:128, ...), a preset (muon, adamw) "
        "or rules '[GLOB=]NAME,...' (default: elementwise)",
    )
    p.add_argument(
        "--alignment-bytes",
        type=int,
        default=16,
        help="segment alignment in bytes: a power of two up to 4096 (default 16)",
    )
    p.add_argument(
        "--policy",
        default="auto",
        help="placement of compute units coarser than their placement units (Muon matrices, Shampoo stripes, "
        "experts): auto (default: per tensor, by bytes moved), whole (on one rank: what fully_shard builds "
        "today) or owner (storage cut finely, each cut unit computed at an owner rank)",
    )
    p.add_argument(
        "--quantized-gather",
        action="store_true",
        help="plan as fully_shard(..., quantized_gather=True): the float weights with mx, mx:4 or fp8_block:B "
        "semantics keep float masters in a layout of their own per group and are all-gathered as their "
        "quantized tiles (payload + scales)",
    )
    p.add_argument(
        "--tile-placement",
        nargs="?",
        const="on",
        default="off",
        choices=("on", "off", "auto"),
        help="plan the fp8_block:B weights in their tile-major order, one tile as the placement unit "
        "(docs/design.md, 'Tile placement'): what fully_shard(..., tile_placement=True) builds for frozen FP8 "
        "weights and, with --quantized-gather, for trainable masters (in packed tile order); 'auto': frozen ones "
        "per group, whichever pads less (masters by stripes)",
    )


_TILE_PLACEMENT: dict[str, bool | str] = {"on": True, "off": False, "auto": "auto"}


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose refusals are one line, as the commands' own (exit code 2): the
    usage it would print first is one ``--help`` away."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="blockshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="plan a model's block-aligned layout and compare it with FSDP2 / ZeRO")
    _add_model_args(plan)
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    plan.add_argument("--plot", metavar="FILE.png", help="draw per-rank loads to this file")
    plan.add_argument("--layouts", action="store_true", help="with --json: include every group's layout")
    plan.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree: plan a (dp, tp) mesh of --world-size ranks with torchtitan's TP plan "
        "(docs/design.md, 'Tensor and expert parallel plans'); default 1",
    )
    plan.add_argument(
        "--ep", type=int, default=1, help="expert-parallel degree: stacked experts sharded by expert (default 1)"
    )
    inspect = sub.add_parser(
        "inspect",
        help="show one group's layout, what one rank holds, or what a checkpoint directory holds (DCP or DeepSpeed ZeRO-1/2)",
    )
    inspect.add_argument(
        "checkpoint", nargs="?", help="a checkpoint directory written by dcp.save(model.state_dict(), ...)"
    )
    _add_model_args(inspect, required=False)
    inspect.add_argument("--group", help="group name (default: the first group that is not the root)")
    inspect.add_argument("--rank", type=int, help="show the pieces this rank holds")
    inspect.add_argument("--json", action="store_true", help="print the layout as JSON")
    rep = sub.add_parser("report", help="show a run report saved from blockshard.report(model).to_json()")
    rep.add_argument(
        "file", metavar="FILE.json", help="a report written by json.dump(blockshard.report(...).to_json(), f)"
    )
    rep.add_argument("--json", action="store_true", help="print the report as JSON instead of the tables")
    rep.add_argument("--plot", metavar="FILE.png", help="draw the bytes held per rank (and total / W) to this file")
    demo = sub.add_parser(
        "demo", help="the main job: train a tiny Llama on W gloo ranks and check it equals one process bitwise"
    )
    demo.add_argument("--world-size", "-W", type=int, default=2, help="number of gloo ranks (default 2)")
    demo.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    demo.add_argument(
        "--semantics", default="muon", help="block semantics, as for `plan` (default: muon, whole hidden matrices)"
    )
    demo.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default="muon",
        help="muon (default: torch Muon on the whole hidden matrices each rank owns, AdamW on the rest) or adamw",
    )
    _add_accelerate_config(sub)
    ds = sub.add_parser(
        "deepspeed-to-dcp",
        help="write a DeepSpeed ZeRO-1/2/3 checkpoint as a DCP checkpoint any engine resumes (set_state_dict)",
    )
    ds.add_argument("checkpoint", help="the directory engine.save_checkpoint wrote")
    ds.add_argument("out", help="the DCP checkpoint directory to write")
    ds.add_argument("--tag", help="the tag save_checkpoint used (default: the checkpoint's 'latest')")
    rs = sub.add_parser(
        "deepspeed-reshard",
        help="rewrite a DeepSpeed ZeRO-3 checkpoint of blockshard's owner-compute for another world size",
    )
    rs.add_argument("checkpoint", help="the directory engine.save_checkpoint wrote")
    rs.add_argument("out", help="the checkpoint directory to write (load it with engine.load_checkpoint)")
    rs.add_argument("--world-size", type=int, required=True, help="the number of ranks that will load it")
    rs.add_argument("--tag", help="the tag save_checkpoint used (default: the checkpoint's 'latest')")
    return parser


def _add_accelerate_config(sub: argparse._SubParsersAction[_Parser]) -> None:
    acc = sub.add_parser(
        "accelerate-config",
        help="write the Accelerate config files that make `accelerate launch` train with blockshard",
    )
    acc.add_argument("--engine", default="ragged", help="ragged (default: blockshard.fully_shard), fsdp2 or deepspeed")
    acc.add_argument("--num-processes", type=int, default=2, help="processes per machine: 1 to 1024 (default 2)")
    acc.add_argument("--cpu", action="store_true", help="train on CPU over gloo")
    acc.add_argument("--semantics", default="elementwise", help="block semantics, as for `plan` (default elementwise)")
    acc.add_argument("--policy", default="auto", help="auto (default), whole or owner (ragged engine)")
    acc.add_argument("--layers", default="LlamaDecoderLayer", help="layer classes, one group each (comma-separated)")
    acc.add_argument("--out", default=".", help="directory to write accelerate.yaml (and deepspeed.json) into")


def _cmd_accelerate_config(args: argparse.Namespace) -> int:
    # mypy checks integrations/ as the package `integrations` (pyproject's [tool.mypy]): it cannot
    # resolve the installed name, which setuptools' package-dir maps at import time.
    from blockshard.integrations.accelerate._files import write_configs  # type: ignore[import-not-found]

    argv = (
        f"--engine {args.engine} --num-processes {args.num_processes}{' --cpu' if args.cpu else ''} --semantics "
        f"'{args.semantics}' --policy {args.policy} --layers {args.layers} --out {args.out}"
    )
    options = dict(num_processes=args.num_processes, cpu=args.cpu, semantics=args.semantics, policy=args.policy)
    paths = write_configs(args.out, engine=args.engine, layers=args.layers, argv=argv, **options)
    for path in paths:
        print(f"wrote {path}")
    print(
        f"launch: {'DS_ACCELERATOR=cpu ' if args.cpu and args.engine == 'deepspeed' else ''}accelerate launch --config_file {paths[0]} your_script.py"
    )
    return 0


def _cmd_deepspeed_to_dcp(args: argparse.Namespace) -> int:
    from blockshard.integrations.deepspeed import export_dcp  # type: ignore[import-not-found]  # see above

    summary = export_dcp(args.checkpoint, args.out, tag=args.tag)
    print(
        f"wrote {summary.path}: {summary.parameters} parameters and their optimizer state "
        f"({', '.join(summary.state_keys)}) from ZeRO-{summary.zero_stage} on {summary.world_size} ranks"
        f"{' (blockshard hook)' if summary.hooked else ''}; load with dcp.load + set_state_dict"
    )
    return 0


def _cmd_deepspeed_reshard(args: argparse.Namespace) -> int:
    from blockshard.integrations.deepspeed import reshard_zero3_checkpoint

    where = reshard_zero3_checkpoint(args.checkpoint, args.out, args.world_size, tag=args.tag)
    print(f"wrote {where} for {args.world_size} ranks; load it with engine.load_checkpoint({str(args.out)!r})")
    return 0


def _check_args(args: argparse.Namespace) -> None:
    """The arguments that need no model, checked before any reading or planning."""
    from blockshard.planner._policy import check_policy
    from blockshard.planner._units import check_alignment_bytes, check_world_size

    check_world_size(args.world_size, "--world-size")
    check_alignment_bytes(args.alignment_bytes, "--alignment-bytes")
    check_policy(args.policy, "--policy")


def _load(args: argparse.Namespace) -> ModelPlan:
    """Read the model and plan it, under a progress bar on stderr (a large shapes file takes a while)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from blockshard._render import console
    from blockshard.planner import load_model_tensors, plan_model

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    err = console(stderr=True)
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task(f"reading {_source(args)}", total=None)
        tensors = load_model_tensors(model=args.model, config=args.config, shapes=args.shapes)
        bar.update(task, description=f"planning {len(tensors):,} tensors on {args.world_size:,} ranks")

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return plan_model(
            tensors,
            args.world_size,
            semantics=args.semantics,
            alignment_bytes=args.alignment_bytes,
            progress=progress,
            policy=args.policy,
            quantized_gather=args.quantized_gather,
            tile_placement=_TILE_PLACEMENT[args.tile_placement],
        )


def _plan_parallel(args: argparse.Namespace) -> int:
    """``plan --tp N --ep M``: the (dp, tp, ep) mesh ([Note: TP and EP plans])."""
    from blockshard._render import console, parallel_tables
    from blockshard.planner import load_model_tensors
    from blockshard.planner._parallel import plan_parallel

    if args.plot or args.quantized_gather or args.tile_placement != "off":
        raise PlanError("--tp / --ep plan without --plot, --quantized-gather or --tile-placement. Fix: drop those")
    tensors = load_model_tensors(model=args.model, config=args.config, shapes=args.shapes)
    with console(stderr=True).status(f"planning {len(tensors):,} tensors on {args.world_size:,} ranks ..."):
        plan = plan_parallel(
            tensors, args.world_size, tp=args.tp, ep=args.ep, semantics=args.semantics, policy=args.policy
        )
    if args.json:
        data = plan.to_json()
        if not args.layouts:
            del data["placements"]
        json.dump({"model": _source(args), **data}, sys.stdout, indent=2)
        print()
        return 0
    for table in parallel_tables(plan, f"{_source(args)} · semantics {args.semantics} · policy {args.policy}"):
        console().print(table)
    return 0


def _source(args: argparse.Namespace) -> str:
    source: str = args.model or args.config or args.shapes
    return source


def _cmd_plan(args: argparse.Namespace) -> int:
    from blockshard._render import (
        comparison_table,
        compute_table,
        console,
        plot_rank_loads,
        policy_table,
        quantized_gather_table,
        quantized_table,
    )
    from blockshard.planner import compare

    _check_args(args)
    if args.tp != 1 or args.ep != 1:
        return _plan_parallel(args)
    if args.plot:
        from blockshard._render import check_plot_path

        check_plot_path(args.plot)
    plan = _load(args)
    with console(stderr=True).status(f"comparing with FSDP2 and ZeRO on {args.world_size:,} ranks ..."):
        cmp = compare(plan)
    title = f"{_source(args)} · W = {args.world_size} · semantics {args.semantics} · policy {args.policy}"
    if args.quantized_gather:
        title += " · quantized gather"
    if args.tile_placement != "off":
        title += " · fp8 tiles placed tile-major" + (" where they pad less" if args.tile_placement == "auto" else "")
    if args.plot:
        plot_rank_loads(cmp, args.plot, title)
    if args.json:
        data = cmp.to_json()
        data.update(model=_source(args), semantics=args.semantics, policy=args.policy)
        if args.layouts:
            data["layouts"] = [g.to_json() for g in cmp.plan.groups]
            data |= cmp.plan.quantized_groups_json()
        json.dump(data, sys.stdout, indent=2)
        print()
    else:
        console().print(comparison_table(cmp, title))
        console().print(compute_table(cmp))
        if cmp.plan.policy_by_tensor_kind():
            console().print(policy_table(cmp.plan))
        if cmp.plan.quantized_groups:
            console().print(quantized_table(cmp.plan))
        if cmp.plan.quantized_gather_groups:
            console().print(quantized_gather_table(cmp.plan))
        if args.plot:
            console().print(f"per-rank loads drawn to {args.plot}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from blockshard._render import console, layout_table

    has_model = bool(args.model or args.config or args.shapes)
    if args.checkpoint is not None and not has_model:
        return _cmd_inspect_checkpoint(args)
    if args.checkpoint is not None or not has_model:
        raise BlockshardError(
            "inspect takes either a checkpoint directory (blockshard inspect DIR) or a model (--model, "
            "--config or --shapes), not both and not neither"
        )
    _check_args(args)
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        raise BlockshardError(
            f"--rank={args.rank} must be in [0, {args.world_size}) for --world-size {args.world_size}; "
            "pass a rank of the world"
        )
    plan = _load(args)
    if args.group is None:
        layout = next((g for g in plan.groups if g.name), plan.groups[0])
    else:
        layout = plan.group(args.group)
    if args.json:
        json.dump(layout.to_json() | {"layout_hash": layout.layout_hash()}, sys.stdout, indent=2)
        print()
    else:
        console().print(layout_table(layout, args.rank))
    return 0


def _cmd_inspect_checkpoint(args: argparse.Namespace) -> int:
    from blockshard._render import checkpoint_table, console
    from blockshard.runtime import describe_checkpoint

    if _is_deepspeed(args.checkpoint):  # what engine.save_checkpoint wrote (ZeRO-1/2/3)
        from blockshard.integrations.deepspeed._dcp import describe_deepspeed_checkpoint  # type: ignore[import-not-found]

        info = describe_deepspeed_checkpoint(args.checkpoint)
    else:
        info = describe_checkpoint(args.checkpoint)
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        print()
    else:
        console().print(checkpoint_table(info))
    return 0 if info["complete"] else 1


def _is_deepspeed(path: str) -> bool:
    p = Path(path)
    zero3 = p.is_dir() and any(
        f.name.startswith("zero_pp_rank_") and f.name.endswith("_model_states.pt") for f in p.iterdir()
    )
    return (p / "latest").is_file() or (p / "mp_rank_00_model_states.pt").is_file() or zero3


def _cmd_report(args: argparse.Namespace) -> int:
    from blockshard._errors import ReportError
    from blockshard._render import console
    from blockshard.runtime._report import Report

    with open(args.file, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ReportError(
                f"{args.file!r} is not JSON ({e}); pass a file written by json.dump(blockshard.report(...).to_json(), f)"
            ) from None
    rep = Report.from_json(data)
    if args.json:
        json.dump(rep.to_json(), sys.stdout, indent=2)
        print()
    else:
        rep.render(console())
    if args.plot:
        rep.plot(args.plot)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from blockshard._demo import run_demo

    return run_demo(world_size=args.world_size, steps=args.steps, semantics=args.semantics, optimizer=args.optimizer)


def _cmd_list(_: argparse.Namespace) -> int:
    from blockshard.planner import catalog_models, model_tensors

    for name in catalog_models():
        print(f"{name:16s} {sum(t.numel for t in model_tensors(name)) / 1e9:8.2f}B parameters")
    return 0


def _os_error(exc: OSError) -> str:
    """One line for a failed read or write: the output (stdout), or the file, and the cause."""
    cause = exc.strerror or str(exc)
    if exc.filename is None:  # a write to stdout: /dev/full, a full disk
        _stdout_to_devnull()
        return f"writing the output failed ({cause}); send it where it can be written (a file system with free space)"
    return f"{exc.filename!r}: {cause}; pass a path that can be read or written (not under a file, not in /proc)"


def _stdout_to_devnull() -> None:
    """What stdout still buffers would fail again at exit ("Exception ignored ... OSError"): point its
    file descriptor at /dev/null (the remedy the Python docs give for a closed pipe)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # captured (tests) or already closed
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if getattr(args, "list_models", False):
            code = _cmd_list(args)
        else:
            commands = {"plan": _cmd_plan, "inspect": _cmd_inspect, "report": _cmd_report, "demo": _cmd_demo}
            extra = {
                "accelerate-config": _cmd_accelerate_config,
                "deepspeed-to-dcp": _cmd_deepspeed_to_dcp,
                "deepspeed-reshard": _cmd_deepspeed_reshard,
            }
            code = {**commands, **extra}[args.command](args)
        sys.stdout.flush()  # a write that fails fails here, not at exit
        return code
    except BlockshardError as exc:  # bad input: one clear line, exit 2 (like argparse)
        print(f"blockshard {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader closed the pipe (| head): quiet, exit 1, as rich does for tables
        _stdout_to_devnull()
        return 1
    except OSError as exc:  # the output cannot be written (or a file read): one line, exit 2
        print(f"blockshard {args.command}: error: {_os_error(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
