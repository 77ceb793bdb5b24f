"""Muon's step on tensor-parallel matrices: Newton-Schulz once per matrix at a tp owner vs on every tp rank.

    python benchmarks/muon_tp.py --tp 2 --json --out docs/results/muon_tp.json

One run spawns ``--tp`` gloo ranks (``blockshard._launch.spawn_gloo``, one thread per rank) as a
(dp 1, tp T) mesh. Every rank builds the same stack of transformer-like blocks (q/k/v/o attention
projections and a SwiGLU MLP, all 2-D, no biases), applies torch's tensor parallelism to each block
(``ColwiseParallel`` q, k, v, gate, up; ``RowwiseParallel`` o, down), shards each block with
``blockshard.fully_shard`` over the dp mesh, and steps every matrix with ``blockshard.optim.Muon``,
which runs Newton-Schulz on the *global* matrix ([Note: Muon across tensor parallelism] in
``blockshard/optim/_muon.py``). Two ways, two models in the same processes (same seed, same batches),
alternating step by step (the order rotating):

1. **owners** (blockshard's): each TP-split matrix gets one tp owner (largest Newton-Schulz first, to
   the least-loaded tp rank); one ``all_to_all_single`` over tp sends the directions to the owners,
   the owner runs Newton-Schulz, a second sends each tp rank its rows (columns) of the result.
2. **every_rank** (the baseline, the way before): every tp rank all-gathers every matrix's direction
   and runs Newton-Schulz on it, keeping its own rows (columns): the same result, tp times the work.

Timing: forward and backward are not timed. A ``dist.barrier()`` precedes every timed step; a step's
time is the slowest rank's ``optimizer.step()``; medians over ``--steps`` timed steps after
``--warmup``. Counted: the step's collectives (``collective_counts()``: calls and bytes per rank), and
the largest parameter difference between the two models after the run (0: the same numbers).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _common import add_output_args, command, emit, machine_facts, parser
from torch import nn

WAYS = ("owners", "every_rank")
MODEL_DEFAULTS = {"hidden": 256, "intermediate": 704, "blocks": 4}


class Block(nn.Module):
    def __init__(self, h: int, i: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / x.shape[-1] ** 0.5, dim=-1) @ self.v(x)
        x = x + self.o(a)
        return x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def _build(cfg: dict, tp_mesh, dp_mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import blockshard

    torch.manual_seed(0)
    model = nn.Sequential(*(Block(cfg["hidden"], cfg["intermediate"]) for _ in range(cfg["blocks"])))
    plan = {n: ColwiseParallel() for n in ("q", "k", "v", "gate", "up")} | {
        "o": RowwiseParallel(),
        "down": RowwiseParallel(),
    }
    for b in model:
        parallelize_module(b, tp_mesh, plan)
        blockshard.fully_shard(b, mesh=dp_mesh, semantics="muon")
    blockshard.fully_shard(model, mesh=dp_mesh, semantics="muon")
    return model


def _rank_main(rank: int, world: int, opts: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from blockshard.optim import Muon, muon_param_groups

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    models, opts_ = {}, {}
    for way in WAYS:
        models[way] = _build(opts["model"], mesh["tp"], mesh["dp"])
        opts_[way] = Muon(muon_param_groups(models[way])[0], lr=0.02)
        opts_[way].ns_across_tp = way
    g = torch.Generator().manual_seed(1)
    h = opts["model"]["hidden"]
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    for step in range(opts["warmup"] + opts["steps"]):
        x, y = torch.randn(2, 16, h, generator=g), torch.randn(2, 16, h, generator=g)
        order = WAYS if step % 2 == 0 else WAYS[::-1]
        for way in order:
            ((models[way](x) - y) ** 2).mean().backward()
            dist.barrier()
            t0 = time.perf_counter()
            opts_[way].step()
            elapsed = time.perf_counter() - t0
            opts_[way].zero_grad()
            if step >= opts["warmup"]:
                times[way].append(elapsed)
    import blockshard

    full = {w: blockshard.full_state_dict(models[w]) for w in WAYS}
    diff = max((full["owners"][n] - full["every_rank"][n]).abs().max().item() for n in full["owners"])
    counts = {
        w: [
            {"kind": c.kind, "calls": c.calls, "bytes": c.bytes, "ranks": c.ranks}
            for c in opts_[w].collective_counts()
            if c.ranks == world
        ]
        for w in WAYS
    }
    return {"times": times, "max_param_diff": diff, "counts": counts}


def render(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"blockshard.optim.Muon on TP-split matrices — tp {report['tp']}, {report['steps']} timed steps (gloo, CPU)"
    )
    t.add_column("metric")
    for w in WAYS:
        t.add_column(w, justify="right")
    v = report["ways"]
    t.add_row("step time, median (s)", *(f"{v[w]['step_time_s']['median']:.4f}" for w in WAYS))
    t.add_row("step time, min (s)", *(f"{v[w]['step_time_s']['min']:.4f}" for w in WAYS))
    t.add_row("collective calls over tp / rank", *(str(v[w]["tp_calls_per_rank"]) for w in WAYS))
    t.add_row("MiB over tp / rank", *(f"{v[w]['tp_bytes_per_rank'] / 2**20:.3f}" for w in WAYS))
    r = report["ratios"]
    t.caption = (f"owners / every_rank step time {r['owners_over_every_rank_step_time']:.2f}x; "
                 f"max |param difference| {report['max_param_diff']:.1e}")  # fmt: skip
    Console(stderr=True, width=120).print(t)


def main(argv: list[str] | None = None) -> dict:
    from blockshard._launch import spawn_gloo

    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser(__doc__, world_size=None, steps=10, warmup=2)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (the number of ranks)")
    for key, val in MODEL_DEFAULTS.items():
        p.add_argument(f"--{key}", type=int, default=val, help=f"model size (default {val})")
    a = add_output_args(p, timeout=1800.0).parse_args(argv)
    if a.tp < 2 or a.steps < 1 or a.warmup < 0:
        raise SystemExit("need --tp >= 2, --steps >= 1, --warmup >= 0")
    cfg = {k: getattr(a, k) for k in MODEL_DEFAULTS}
    for k in ("hidden", "intermediate"):
        if cfg[k] % a.tp:
            raise SystemExit(f"--{k} {cfg[k]} must be a multiple of --tp {a.tp}")
    opts = {"model": cfg, "steps": a.steps, "warmup": a.warmup}
    t0, load_before = time.perf_counter(), os.getloadavg()
    per_rank = spawn_gloo(_rank_main, a.tp, args=(opts,), timeout=a.timeout, threads=1)
    step_times = {w: [max(r["times"][w][i] for r in per_rank) for i in range(a.steps)] for w in WAYS}
    ways = {}
    for w in WAYS:
        rows = per_rank[0]["counts"][w]
        ways[w] = {
            "step_time_s": {"median": statistics.median(step_times[w]), "min": min(step_times[w])},
            "tp_calls_per_rank": sum(c["calls"] for c in rows) // (a.steps + a.warmup),
            "tp_bytes_per_rank": max(sum(c["bytes"] for c in r["counts"][w]) for r in per_rank) // (a.steps + a.warmup),
            "collectives_rank0": rows,
        }
    report = {
        "benchmark": "muon_tp",
        "command": command("muon_tp.py", argv),
        "tp": a.tp,
        "steps": a.steps,
        "warmup": a.warmup,
        "model": {**cfg, "matrices_per_block": 7},
        "timing": "median over timed steps of the slowest rank's optimizer step (a barrier before each); the two "
        "ways alternate in the same processes, order rotating every step; forward and backward untimed",
        "machine": machine_facts(oversubscribed=a.tp > (os.cpu_count() or 1), load_before=load_before),
        "ways": ways,
        "ratios": {
            "owners_over_every_rank_step_time": ways["owners"]["step_time_s"]["median"]
            / ways["every_rank"]["step_time_s"]["median"]
        },
        "max_param_diff": max(r["max_param_diff"] for r in per_rank),
        "wall_seconds": time.perf_counter() - t0,
    }
    return emit(report, render=render, out=a.out, as_json=a.json)


if __name__ == "__main__":
    main()
