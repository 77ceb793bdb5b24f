"""The engine on real devices, under torchrun: blockshard against FSDP2 and one process.

    torchrun --nproc-per-node 2 benchmarks/gpu_check.py --device cuda --json --out gpu_check.json

Run by ``benchmarks/gpu_check.sh`` (NCCL on 2+ GPUs; gloo on the CPU as a dry check). Every rank
trains the same tiny Llama on the whole batch (so the averaged gradients equal one process's) with
AdamW: sharded by blockshard (each decoder layer, then the root) with gradient views on and again
with them off (the copy path), once by FSDP2, and rank 0 once unsharded. Reported (rank 0, JSON): the largest parameter difference of each engine from the
unsharded run after the last step, each engine's median step time (after ``--warmup`` untimed
steps; the slowest rank, after a barrier) and peak device memory (``torch.cuda.max_memory_allocated``
on CUDA; not measured on the CPU), and their ratios. Exits 1 if blockshard's difference exceeds
``--atol`` (0 on the CPU: bitwise, as the gloo tests promise; NCCL's reductions may round
differently from one process, so 1e-5 on GPUs by default).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

# blockshard with gradient views (as the default on NCCL) and without (the copy path), and FSDP2
ENGINES = ("blockshard", "blockshard-no-views", "fsdp2")


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--atol", type=float, default=None, help="default: 0 on the CPU, 1e-5 on GPUs")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _train(engine: str, device: torch.device, steps: int, warmup: int) -> tuple[dict, list[float], int]:
    import blockshard
    from blockshard._tiny import text_batches, tiny_llama

    model = tiny_llama(0, num_hidden_layers=3).to(device)
    if engine.startswith("blockshard"):
        for layer in model.model.layers:
            blockshard.fully_shard(layer)
        blockshard.fully_shard(model)
        model.set_gradient_views(engine == "blockshard")  # [Note: gradient views]: on, or off for the copy path
    elif engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i, (ids, labels) in enumerate(text_batches(warmup + steps, 4, 32)):
        if engine != "single":
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        model(input_ids=ids.to(device), labels=labels.to(device)).loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    if engine.startswith("blockshard"):
        params = blockshard.full_state_dict(model)
    elif engine == "fsdp2":
        params = {n: p.full_tensor() for n, p in model.named_parameters()}
    else:
        params = {n: p.detach() for n, p in model.named_parameters()}
    return {n: t.detach().float().cpu() for n, t in params.items()}, times, peak


def main(argv: list[str]) -> int:
    a = _args(argv)
    backend = "nccl" if a.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    atol = a.atol if a.atol is not None else (0.0 if a.device == "cpu" else 1e-5)
    report: dict = {"benchmark": "gpu_check", "backend": backend, "world_size": world, "device": str(device)}
    results = {e: _train(e, device, a.steps, a.warmup) for e in ENGINES}
    slowest = {}
    for e, (_, times, _) in results.items():
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[e] = statistics.median(t.tolist())
    ok = True
    if rank == 0:
        want, _, _ = _train("single", device, a.steps, a.warmup)
        for e, (params, _, peak) in results.items():
            diff = max((params[n] - v).abs().max().item() for n, v in want.items())
            report[e] = {"max_abs_diff_from_one_process": diff, "median_step_s": slowest[e], "peak_bytes": peak}
        b, c, f = report["blockshard"], report["blockshard-no-views"], report["fsdp2"]
        report["ratios"] = {
            "step_time": b["median_step_s"] / f["median_step_s"],
            "peak_memory": (b["peak_bytes"] / f["peak_bytes"]) if f["peak_bytes"] else None,
            "step_time_no_views": c["median_step_s"] / f["median_step_s"],
            "peak_memory_no_views": (c["peak_bytes"] / f["peak_bytes"]) if f["peak_bytes"] else None,
        }
        report["ratios_divide"] = "blockshard's figure / FSDP2's, both measured in the same run"
        report["atol"] = atol
        ok = max(b["max_abs_diff_from_one_process"], c["max_abs_diff_from_one_process"]) <= atol
        report["ok"] = ok
        text = json.dumps(report, indent=2)
        if a.out:
            with open(a.out, "w") as fh:
                fh.write(text + "\n")
        print(text if a.json else f"gpu_check: {'ok' if ok else 'FAILED'} {report['ratios']}")
    flag = torch.tensor([int(ok)], device=device if backend == "nccl" else "cpu")
    dist.broadcast(flag, 0)
    del results
    gc.collect()  # the engines' process groups go while the interpreter is whole (gloo can abort a rank at exit)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if flag.item() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
