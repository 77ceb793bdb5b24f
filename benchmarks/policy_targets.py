"""Placement-policy targets, measured with the CLI as a user runs it (issue 10's planner targets).

    python benchmarks/policy_targets.py --out docs/results/policy_targets.json --markdown docs/results/policy_targets.md

Every row is one ``python -m blockshard plan --model M -W W --semantics S --policy P --json`` (the
command is recorded beside its numbers): padding, the busiest rank's optimizer cost over
``max(mean, largest compute unit)``, all_to_all and optimizer-state bytes per rank, and the
planning time ``plan_seconds`` (``plan_model`` alone; the min over ``--repeats`` runs for the
planning-time rows). Targets (checked and reported, not asserted): ``auto`` pads <= 1% and the
busiest rank's cost is <= 1.05 x the bound; Llama-3-405B at W = 16384 plans in <= 0.3 s.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import shlex
import subprocess
import sys

CASES = [
    *(
        (m, W, "muon", p)
        for m, W in (("llama3-8b", 8), ("llama3-8b", 64), ("llama3-8b", 512))
        for p in ("whole", "auto")
    ),
    *((m, W, "muon", p) for m, W in (("llama3-70b", 1024), ("llama3-70b", 16384)) for p in ("whole", "auto")),
    *(("llama3-405b", W, "muon", p) for W in (1024, 16384) for p in ("whole", "auto")),
    ("llama3-8b", 8, "muon", "owner"),
    ("llama3-70b", 1024, "shampoo:1024", "auto"),
    ("llama3-70b", 1024, "fp8_block:128", "auto"),
    ("mixtral-8x7b", 64, "muon", "auto"),
    ("deepseek-v3", 1024, "muon", "auto"),
    ("deepseek-v3", 1024, "expert", "auto"),
]
TIMED = [("llama3-405b", 16384, "muon", "auto"), ("llama3-405b", 16384, "muon", "whole")]
KEYS = (
    "padding_fraction",
    "optimizer_cost_max_over_lower_bound",
    "optimizer_cost_per_rank_max",
    "optimizer_cost_lower_bound",
    "all_to_all_bytes_per_rank_max",
    "all_to_all_bytes_per_rank_mean",
    "optimizer_state_bytes_per_rank_max",
    "optimizer_state_bytes_per_rank_mean",
    "owner_tensors",
    "plan_seconds",
)


def _cli(model: str, W: int, sem: str, policy: str) -> tuple[str, dict]:
    args = ["plan", "--model", model, "-W", str(W), "--semantics", sem, "--policy", policy, "--json"]
    out = subprocess.run([sys.executable, "-m", "blockshard", *args], capture_output=True, text=True, check=True)
    return "blockshard " + shlex.join(args), json.loads(out.stdout)


def _row(model: str, W: int, sem: str, policy: str) -> dict:
    cmd, data = _cli(model, W, sem, policy)
    return {"command": cmd, "model": model, "world_size": W, "semantics": sem, "policy": policy,
            **{k: data[k] for k in KEYS}}  # fmt: skip


def _gb(x: float) -> str:
    return f"{x / 1e9:.3f} GB"


def _markdown(result: dict) -> str:
    lines = [
        "| command | padding | cost max / max(mean, largest) | all_to_all / rank (max, mean) "
        "| opt state / rank (max, mean) | owner tensors | plan time |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["cases"]:
        lines.append(
            f"| `{r['command'].removesuffix(' --json')}` | {100 * r['padding_fraction']:.4f}% "
            f"| {r['optimizer_cost_max_over_lower_bound']:.4f} "
            f"| {_gb(r['all_to_all_bytes_per_rank_max'])}, {_gb(r['all_to_all_bytes_per_rank_mean'])} "
            f"| {_gb(r['optimizer_state_bytes_per_rank_max'])}, {_gb(r['optimizer_state_bytes_per_rank_mean'])} "
            f"| {r['owner_tensors']:,} | {1e3 * r['plan_seconds']:.0f} ms |"
        )
    lines += ["", "| planning time (min of runs) | seconds |", "|---|---:|"]
    for t in result["planning_time"]:
        lines.append(f"| `{t['command'].removesuffix(' --json')}` | {t['seconds_min']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the JSON report here")
    ap.add_argument("--markdown", help="also write the table as Markdown here (for docs/)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    rows = [_row(*case) for case in CASES]
    timed = []
    for case in TIMED:
        runs = [_cli(*case) for _ in range(args.repeats)]
        timed.append({"command": runs[0][0], "seconds_min": min(d["plan_seconds"] for _, d in runs),
                      "seconds_all": [d["plan_seconds"] for _, d in runs], "target_seconds": 0.3})  # fmt: skip
    argv_text = shlex.join(argv if argv is not None else sys.argv[1:])
    result = {
        "command": f"python benchmarks/policy_targets.py {argv_text}".strip(),
        "machine": {"python": platform.python_version(), "processor": platform.machine()},
        "cases": rows,
        "planning_time": timed,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    if args.markdown:
        pathlib.Path(args.markdown).write_text(_markdown(result))
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
