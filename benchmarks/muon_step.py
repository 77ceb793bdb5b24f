"""Muon's optimizer step, six ways: ragged engine (whole matrices; owner-compute; momentum-sharded),
FSDP2 + owner-compute, FSDP2 + plain Muon, gather-everywhere.

    python benchmarks/muon_step.py --world-size 4 --json --out docs/results/muon_step.json

One run spawns W gloo ranks (``blockshard._launch.spawn_gloo``, ``torch.set_num_threads(1)`` on every
rank). Every rank builds one model per variant (same seed: a stack of transformer-like blocks whose 2-D
weights -- q/k/v/o and a SwiGLU MLP -- get Muon and whose RMSNorm weights get AdamW) and trains all of
them in the same processes, step by step, the variants alternating (the order rotates every step, so
drift of the machine hits all alike):

1. **ragged**: ``blockshard.fully_shard`` with ``matrix`` semantics on the 2-D weights. Each rank's
   parameters are whole matrices (or empty pieces), so unmodified ``torch.optim.Muon`` steps the local
   whole matrices: no communication in the step.
2. **fsdp2+owner**: stock FSDP2 (``blockshard.integrations.fsdp2.fully_shard``: FSDP2's ``Shard(0)``,
   which splits every matrix here) and ``fsdp2.OwnerComputeOptimizer`` with inner ``torch.optim.Muon``:
   one ``all_to_all_single`` moves the gradient pieces of each matrix to its owner (owners chosen by
   ``blockshard.planner.plan_owners``, balancing Newton-Schulz FLOPs), Muon runs there on whole
   matrices, a second ``all_to_all_single`` moves the new values back.
3. **fsdp2+plain-muon**: stock ``torch.distributed.fsdp.fully_shard`` and ``torch.optim.Muon`` directly
   on the DTensor parameters. What happens is recorded; if the step raises, the error is reported and
   the variant has no numbers.
4. **gather-everywhere**: the Moonshot / DeepSpeed ZeRO-1/2 way, on stock FSDP2's row shards: each rank
   updates the momentum of its shard, all-gathers every matrix's (Nesterov) update direction
   (``all_gather_into_tensor``, issued asynchronously for all matrices at once), runs Newton-Schulz on
   every whole matrix and keeps its own rows of the result. Numerically the same as Muon on one process.
5. **ragged+owner**: ``blockshard.fully_shard(..., policy="owner")``: storage cut anywhere (no padding
   for the matrices), every cut matrix computed at an owner by ``blockshard.optim.OwnerComputeOptimizer``
   around ``torch.optim.Muon`` (one ``all_to_all_single`` of gradient pieces in, one of new values back).
6. **ragged+owner (momentum-sharded)**: the same layout, ``blockshard.optim.Muon``: momentum stays on the
   shards; only the Nesterov direction goes to the owner and the orthogonalized update comes back.

Timing: forward and backward are not timed. A ``dist.barrier()`` precedes every timed Muon step; a
step's time is the slowest rank's ``muon.step()``; medians are over the timed steps (after
``--warmup`` untimed ones). The AdamW step on the norms and ``zero_grad`` follow, untimed. Every rank
gets the same batch, so all variants train the same model (the average of W equal gradients is exact
at W in {2, 4}); the report gives each variant's largest parameter difference from the ragged one.

Counted, not timed (one more step per variant under a ``TorchDispatchMode``):

* **Newton-Schulz FLOPs per rank**: ``blockshard.semantics.newton_schulz_flops`` summed over the
  matrices the rank orthogonalizes (from shapes), cross-checked against the FLOPs of the ``mm`` /
  ``addmm`` ops the step dispatched.
* **bytes per rank in the step**: the ``c10d`` collectives the step issued (``all_to_all_single``:
  bytes to / from other ranks, self entries excluded; ``all_gather_into_tensor``: (W-1) x the input
  out, output - input in), next to what the owner plan (``plan.all_to_all_splits``) or the shapes
  predict. Every variant also reduce-scatters gradients in backward and all-gathers parameters in
  forward (the engine's or FSDP2's, the same bytes for all): only the step's own communication is
  compared here.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
from _common import (  # benchmarks/_common.py (scripts run with benchmarks/ on sys.path)
    StepCounter,
    add_output_args,
    check_block_config,
    command,
    emit,
    machine_facts,
    parser,
)
from _muon_variants import ADAMW, MATRIX_SEMANTICS, MUON, VARIANTS, Variant, build, ns_flops
from torch import nn

MODEL_DEFAULTS = dict(blocks=4, hidden=256, kv_dim=64, intermediate=704, heads=4, seq_len=32, batch_size=2)


def matrix_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The Muon matrices (full shapes), in the model's parameter order."""
    return [(n, tuple(p.shape)) for n, p in build(cfg).named_parameters() if p.ndim == 2]


def ragged_packing(cfg: dict, world_sizes) -> dict:
    """Newton-Schulz FLOPs per rank that the ragged engine's layouts give, from the planner alone.

    Mirrors ``blockshard.fully_shard`` on this model: one group per block (``plan_group``), each group
    rotated by whole segments to balance the cost accumulated over the groups before it (the
    engine's cross-group balance, ``blockshard.planner._balance``); the root group (the final norm)
    has no matrices. Also: without the rotation, and with all blocks in one group. Per W:
    ``max rank / (total / W)`` and the number of ranks that orthogonalize anything.
    """
    import numpy as np

    from blockshard.planner import plan_group, resolve_items
    from blockshard.planner._balance import balance, rank_costs
    from blockshard.semantics import TensorSpec

    model = build(cfg)

    def items(block: nn.Module, prefix: str = ""):
        specs = [TensorSpec(name=prefix + n, shape=tuple(p.shape), dtype="float32",
                            module_type=type(block.get_submodule(n.rpartition(".")[0])).__name__)
                 for n, p in block.named_parameters()]  # fmt: skip
        return resolve_items(specs, MATRIX_SEMANTICS)

    def ns(it) -> float:
        return it.cost if it.label == "matrix" else 0.0

    per_block = [items(b) for b in model.blocks]
    total = sum(ns(it) for its in per_block for it in its)
    out = {}
    for w in world_sizes:
        running, plain, rotated = np.zeros(w), np.zeros(w), np.zeros(w)
        for its in per_block:
            layout = plan_group(its, w, name="Block")
            plain += rank_costs(layout, {it.name: ns(it) for it in its})
            layout = balance(layout, {it.name: it.cost for it in its}, running)
            rotated += rank_costs(layout, {it.name: ns(it) for it in its})
        whole = [it for i, b in enumerate(model.blocks) for it in items(b, f"blocks.{i}.")]
        one = rank_costs(plan_group(whole, w, name="Blocks"), {it.name: ns(it) for it in whole})
        out[str(w)] = {name: {"ns_flops_max_rank_over_total_per_rank": float(c.max() / (total / w)),
                              "ranks_with_ns_work": int((c > 0).sum())}
                       for name, c in (("per_block_groups_rotated", rotated), ("per_block_groups_no_rotation", plain),
                                       ("one_group_all_blocks", one))}  # fmt: skip
        out[str(w)]["per_block_groups_rotated"]["ns_flops_per_rank"] = rotated.tolist()
    return out


def _batch(cfg: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)  # the same batch on every rank
    shape = (cfg["batch_size"], cfg["seq_len"], cfg["hidden"])
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# -- one rank ---------------------------------------------------------------------------------------
def _rank_main(rank: int, world_size: int, opts: dict) -> dict:
    os.dup2(2, 1)  # keep the parent's stdout for the JSON report
    torch.set_num_threads(1)
    cfg, warmup, steps = opts["model"], opts["warmup"], opts["steps"]
    variants = [Variant(n, cfg) for n in VARIANTS]
    errors: dict[str, dict] = {}
    for i in range(warmup + steps):
        batch = _batch(cfg, i)
        k = i % len(variants)
        for v in variants[k:] + variants[:k]:
            if v.error is not None:
                continue
            v.forward_backward(batch)
            try:
                v.step(timed=i >= warmup)
            except Exception as e:
                if v.name != "fsdp2+plain-muon":
                    raise
                tb = traceback.extract_tb(e.__traceback__)
                muon_frames = [
                    f"{os.path.basename(f.filename)}:{f.lineno} {f.line}" for f in tb if "_muon" in f.filename
                ]
                v.error = {"type": type(e).__name__, "message": str(e).strip().splitlines()[0],
                           "at_step": i, "where": muon_frames[-1] if muon_frames else None}  # fmt: skip
                errors[v.name] = v.error
                dist.barrier()  # every rank fails alike (same shapes); resynchronize
    counted = {}
    batch = _batch(cfg, warmup + steps)
    for v in variants:  # one more step each, counted (not timed)
        if v.error is not None:
            continue
        v.forward_backward(batch)
        dist.barrier()
        counter = StepCounter(rank, world_size)
        with counter:
            if v.muon is not None:
                v.muon.step()
        if v.adamw is not None:
            v.adamw.step()
        for o in (v.muon, v.adamw):
            if o is not None:
                o.zero_grad()
        sent, recv = counter.totals()
        counted[v.name] = {"collectives": counter.collectives, "bytes_sent": sent, "bytes_received": recv,
                           "matmul_flops": counter.matmul_flops}  # fmt: skip
    ok = [v for v in variants if v.error is None]
    params = {v.name: v.full_params() for v in ok}
    ref = params["ragged"]
    diffs = {n: max(float((p[k] - ref[k]).abs().max()) for k in ref) for n, p in params.items()}
    out = {}
    for v in variants:
        out[v.name] = {"times": v.times, "error": v.error, "planned_bytes": v.planned,
                       "ns_matrices": v.ns_matrices, "counted": counted.get(v.name),
                       "param_max_abs_diff_vs_ragged": diffs.get(v.name), "plan": getattr(v, "plan", None)}  # fmt: skip
    del variants, params
    gc.collect()
    return out


# -- report -----------------------------------------------------------------------------------------
def _aggregate(per_rank: list[dict], opts: dict) -> dict:
    w = len(per_rank)
    shapes = matrix_shapes(opts["model"])
    total_flops = ns_flops(s for _, s in shapes)
    grad_bytes = 4 * sum(math.prod(s) for _, s in shapes)
    packing = ragged_packing(opts["model"], sorted({2, 4, 8, 16, 32, w}))
    variants = {}
    for name in VARIANTS:
        rk = [r[name] for r in per_rank]
        err = next((x["error"] for x in rk if x["error"] is not None), None)
        rec: dict = {"status": "error" if err else "ok"}
        if err:
            rec["error"] = err
            variants[name] = rec
            continue
        slowest = [max(ts) for ts in zip(*(x["times"] for x in rk), strict=True)]
        counted = [x["counted"] for x in rk]
        from_shapes = rk[0]["ns_matrices"] is not None
        flops = [
            ns_flops(s for _, s in x["ns_matrices"]) if from_shapes else c["matmul_flops"]
            for x, c in zip(rk, counted, strict=True)
        ]
        rec.update({
            "step_time_s": {"median": statistics.median(slowest), "min": min(slowest), "max": max(slowest),
                            "per_step_slowest_rank": slowest,
                            "per_rank_median": [statistics.median(x["times"]) for x in rk]},
            "ns_flops_per_rank": flops,
            "ns_flops_source": "newton_schulz_flops of the whole matrices the rank orthogonalizes" if from_shapes
                               else "mm/addmm FLOPs the rank dispatched in the step (DTensor splits the matmuls)",
            "ns_flops_sum_over_ranks": sum(flops),
            "ns_flops_max_over_total_per_rank": max(flops) / (total_flops / w),
            "matmul_flops_dispatched_per_rank": [c["matmul_flops"] for c in counted],
            "ns_matrices_per_rank": [[f"{n} {list(s)}" for n, s in x["ns_matrices"]] for x in rk] if from_shapes else None,
            "step_bytes_sent_per_rank": [c["bytes_sent"] for c in counted],
            "step_bytes_received_per_rank": [c["bytes_received"] for c in counted],
            "step_bytes_planned_per_rank": [x["planned_bytes"][0] for x in rk] if rk[0]["planned_bytes"] else None,
            "step_collectives_rank0": counted[0]["collectives"],
            "param_max_abs_diff_vs_ragged": max(x["param_max_abs_diff_vs_ragged"] for x in rk),
        })  # fmt: skip
        if name == "fsdp2+plain-muon":
            colls = rec["step_collectives_rank0"]
            rec["what_happens"] = (
                "torch.optim.Muon ran on the DTensor parameters: DTensor's sharding propagation redistributes "
                "inside Newton-Schulz, issuing "
                + ", ".join(f"{c['count']} {k}" for k, c in sorted(colls.items()))
                + f" per step on rank 0; the parameters differ from the ragged run (= Muon on one process) by up "
                f"to {rec['param_max_abs_diff_vs_ragged']:.1e}"
            )
        if name == "ragged":
            pred = packing[str(w)]["per_block_groups_rotated"]["ns_flops_per_rank"]
            rec["ns_flops_per_rank_planner_prediction"] = pred
            rec["planner_prediction_matches"] = pred == flops
        if rk[0]["plan"] is not None:
            p = rk[0]["plan"]
            rec["owner_plan"] = {"straddling_units": len(p["straddling_units"]),
                                 "max_cost_over_mean": p["max_cost_over_mean"],
                                 "send_numel_per_rank": p["send_numel_per_rank"],
                                 "recv_numel_per_rank": p["recv_numel_per_rank"]}  # fmt: skip
        variants[name] = rec
    r, o, g = variants["ragged"], variants["fsdp2+owner"], variants["gather-everywhere"]
    ro, rm = variants["ragged+owner"], variants["ragged+owner (momentum-sharded)"]

    def step_bytes(v: dict) -> int:  # the busiest rank, the larger of its two directions
        return max(
            max(a, b) for a, b in zip(v["step_bytes_sent_per_rank"], v["step_bytes_received_per_rank"], strict=True)
        )

    ratios = {
        "gather_everywhere_over_ragged_step_time": g["step_time_s"]["median"] / r["step_time_s"]["median"],
        "owner_over_ragged_step_time": o["step_time_s"]["median"] / r["step_time_s"]["median"],
        "ragged_ns_flops_max_rank_over_total_per_rank": r["ns_flops_max_over_total_per_rank"],
        "owner_ns_flops_max_rank_over_total_per_rank": o["ns_flops_max_over_total_per_rank"],
        "gather_ns_flops_max_rank_over_total_per_rank": g["ns_flops_max_over_total_per_rank"],
        "owner_step_bytes_max_rank_over_2x_grad_bytes_per_rank": step_bytes(o) / (2 * grad_bytes / w),
        "gather_step_bytes_max_rank_over_2x_grad_bytes_per_rank": step_bytes(g) / (2 * grad_bytes / w),
        "ragged_owner_over_fsdp2_owner_step_time": ro["step_time_s"]["median"] / o["step_time_s"]["median"],
        "ragged_owner_over_gather_everywhere_step_time": ro["step_time_s"]["median"] / g["step_time_s"]["median"],
        "momentum_sharded_over_fsdp2_owner_step_time": rm["step_time_s"]["median"] / o["step_time_s"]["median"],
        "momentum_sharded_over_gather_everywhere_step_time": rm["step_time_s"]["median"] / g["step_time_s"]["median"],
        "ragged_owner_step_bytes_max_rank_over_2x_grad_bytes_per_rank": step_bytes(ro) / (2 * grad_bytes / w),
    }
    targets = {
        "ragged_step_at_least_2x_faster_than_gather_everywhere": {
            "value": ratios["gather_everywhere_over_ragged_step_time"], "target": ">= 2",
            "met": ratios["gather_everywhere_over_ragged_step_time"] >= 2.0},
        "ragged_ns_flops_max_rank_le_1.1x_total_over_W": {
            "value": ratios["ragged_ns_flops_max_rank_over_total_per_rank"], "target": "<= 1.1",
            "met": ratios["ragged_ns_flops_max_rank_over_total_per_rank"] <= 1.1},
        "owner_step_bytes_max_rank_le_2x_grad_bytes_over_W": {
            "value": ratios["owner_step_bytes_max_rank_over_2x_grad_bytes_per_rank"], "target": "<= 1",
            "met": ratios["owner_step_bytes_max_rank_over_2x_grad_bytes_per_rank"] <= 1.0},
    }  # fmt: skip
    for v in ("ragged_owner", "momentum_sharded"):
        a, b = ratios[f"{v}_over_fsdp2_owner_step_time"], ratios[f"{v}_over_gather_everywhere_step_time"]
        targets[f"{v}_step_le_fsdp2_owner"] = {"value": a, "target": "<= 1", "met": a <= 1.0}
        targets[f"{v}_step_le_0.3x_gather_everywhere"] = {"value": b, "target": "<= 0.3", "met": b <= 0.3}
    return {"totals": {"ns_flops_total": total_flops, "ns_flops_total_over_W": total_flops / w,
                       "muon_grad_bytes": grad_bytes, "muon_grad_bytes_over_W": grad_bytes / w},
            "variants": variants, "ratios": ratios, "targets": targets,
            "ragged_packing_from_planner": packing}  # fmt: skip


def _gflop(x: float) -> str:
    return f"{x / 1e9:,.3f}"


def _mib(x: float) -> str:
    return f"{x / 2**20:,.3f}"


def render(report: dict) -> None:
    """The side-by-side table, to stderr."""
    from rich.console import Console
    from rich.table import Table

    vs, tot = report["variants"], report["totals"]
    m = report["model"]
    t = Table(title=f"Muon optimizer step — W={report['world_size']}, {m['blocks']} blocks, "
                    f"{m['num_matrices']} matrices, {report['steps']} timed steps (gloo, CPU)")  # fmt: skip
    t.add_column("metric")
    for name in VARIANTS:
        t.add_column(name, justify="right")

    def row(label, fn):
        cells = []
        for name in VARIANTS:
            v = vs[name]
            cells.append(fn(v) if v["status"] == "ok" else "error")
        t.add_row(label, *cells)

    row("step time, median (s)", lambda v: f"{v['step_time_s']['median']:.4f}")
    row("step time, min (s)", lambda v: f"{v['step_time_s']['min']:.4f}")
    row("NS GFLOP / rank (max)", lambda v: _gflop(max(v["ns_flops_per_rank"])))
    row("NS GFLOP / rank (min)", lambda v: _gflop(min(v["ns_flops_per_rank"])))
    row("NS max rank / (total / W)", lambda v: f"{v['ns_flops_max_over_total_per_rank']:.3f}")
    row("matmul GFLOP dispatched (max)", lambda v: _gflop(max(v["matmul_flops_dispatched_per_rank"])))
    row("step MiB sent / rank (max)", lambda v: _mib(max(v["step_bytes_sent_per_rank"])))
    row("step MiB received / rank (max)", lambda v: _mib(max(v["step_bytes_received_per_rank"])))
    row(
        "step MiB planned / rank (max)",
        lambda v: _mib(max(v["step_bytes_planned_per_rank"])) if v["step_bytes_planned_per_rank"] else "—",
    )
    row(
        "collectives in the step (rank 0)", lambda v: str(sum(c["count"] for c in v["step_collectives_rank0"].values()))
    )
    row("max |param - ragged|", lambda v: f"{v['param_max_abs_diff_vs_ragged']:.1e}")
    r = report["ratios"]
    err = vs["fsdp2+plain-muon"].get("error")
    t.caption = (f"NS total {_gflop(tot['ns_flops_total'])} GFLOP, total/W {_gflop(tot['ns_flops_total_over_W'])}; "
                 f"Muon grads {_mib(tot['muon_grad_bytes'])} MiB, 2 x grads/W {_mib(2 * tot['muon_grad_bytes_over_W'])} MiB. "
                 f"gather/ragged step time {r['gather_everywhere_over_ragged_step_time']:.2f}x; "
                 f"owner bytes / (2 x grads/W) {r['owner_step_bytes_max_rank_over_2x_grad_bytes_per_rank']:.3f}; "
                 f"ragged+owner / fsdp2+owner {r['ragged_owner_over_fsdp2_owner_step_time']:.2f}x, "
                 f"/ gather {r['ragged_owner_over_gather_everywhere_step_time']:.2f}x; momentum-sharded / "
                 f"fsdp2+owner {r['momentum_sharded_over_fsdp2_owner_step_time']:.2f}x, "
                 f"/ gather {r['momentum_sharded_over_gather_everywhere_step_time']:.2f}x"
                 + (f"\nfsdp2+plain-muon: {err['type']}: {err['message']} ({err['where']})" if err else ""))  # fmt: skip
    Console(stderr=True, width=140).print(t)
    pk = Table(title="ragged engine: NS FLOPs of the busiest rank / (total / W), from the planner "
                     "(ranks with NS work in parentheses)")  # fmt: skip
    pk.add_column("W", justify="right")
    kinds = ("per_block_groups_rotated", "per_block_groups_no_rotation", "one_group_all_blocks")
    for k in kinds:
        pk.add_column(k.replace("_", " "), justify="right")
    for w, row_ in report["ragged_packing_from_planner"].items():
        pk.add_row(w, *(f"{row_[k]['ns_flops_max_rank_over_total_per_rank']:.3f} ({row_[k]['ranks_with_ns_work']})"
                        for k in kinds))  # fmt: skip
    Console(stderr=True, width=140).print(pk)


def _parser():
    p = parser(__doc__, world_size=4, steps=20, warmup=2)
    for key, val in MODEL_DEFAULTS.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=val, help=f"model size (default {val})")
    return add_output_args(p, timeout=1800.0)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the report (also printed as JSON with --json, written with --out)."""
    from blockshard._launch import spawn_gloo

    argv = sys.argv[1:] if argv is None else list(argv)
    a = _parser().parse_args(argv)
    if a.world_size < 2 or a.steps < 1 or a.warmup < 0:
        raise SystemExit("need --world-size >= 2, --steps >= 1, --warmup >= 0")
    cfg = {k: getattr(a, k) for k in MODEL_DEFAULTS}
    check_block_config(cfg)
    opts = {"model": cfg, "steps": a.steps, "warmup": a.warmup}
    t0, load_before = time.perf_counter(), os.getloadavg()
    per_rank = spawn_gloo(_rank_main, a.world_size, args=(opts,), timeout=a.timeout, threads=1)
    shapes = matrix_shapes(cfg)
    report = {
        "benchmark": "muon_step",
        "command": command("muon_step.py", argv),
        "world_size": a.world_size, "steps": a.steps, "warmup": a.warmup,
        "model": {**cfg, "num_matrices": len(shapes),
                  "matrices": [{"name": n, "shape": list(s), "ns_flops": ns_flops([s])} for n, s in shapes],
                  "num_params": sum(p.numel() for p in build(cfg).parameters()),
                  "architecture": "blocks of RMSNorm + causal GQA attention (q/k/v/o) + RMSNorm + SwiGLU MLP "
                                  "(gate/up/down), no biases, final RMSNorm; fp32; MSE to a random target"},
        "optimizer": {"muon": f"torch.optim.Muon({', '.join(f'{k}={v}' for k, v in MUON.items())}), ns_steps=5, "
                              "bf16 Newton-Schulz (torch's), on every 2-D weight",
                      "adamw": f"torch.optim.AdamW(lr={ADAMW['lr']}) on the RMSNorm weights, not timed"},
        "timing": "median over timed steps of the slowest rank's Muon step (a barrier before each); forward, "
                  "backward, AdamW and zero_grad untimed; variants alternate in the same processes, order "
                  "rotating every step; every rank gets the same batch",
        "machine": machine_facts(oversubscribed=a.world_size > (os.cpu_count() or 1), load_before=load_before),
        **_aggregate(per_rank, opts),
        "notes": [
            "Step communication only: every variant also all-gathers parameters in forward and reduce-scatters "
            "gradients in backward (blockshard's engine or FSDP2, the same bytes), which is not counted here.",
            "ragged: 0 bytes in the step by construction (each rank steps the whole matrices it holds); its NS "
            "balance depends on how the planner packs whole matrices into equal per-rank segments (bytes, not "
            "FLOPs), one group per block.",
            "Bytes per rank: sent = bytes to other ranks, received = bytes from other ranks (self parts excluded); "
            "for the owner all_to_alls and the all-gathers the two are equal on every rank.",
        ],
        "wall_seconds": time.perf_counter() - t0,
    }  # fmt: skip
    return emit(report, render=render, out=a.out, as_json=a.json)


if __name__ == "__main__":
    main()
