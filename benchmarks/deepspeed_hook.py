"""Stock DeepSpeed ZeRO-2 and ZeRO-3 against blockshard-hooked ones in one run: step time, memory, Muon momentum.

    python benchmarks/deepspeed_hook.py --world-size 2 4 --json --out docs/results/deepspeed_hook.json

Each world size W spawns W gloo ranks (``blockshard._launch.spawn_gloo``, one torch thread per rank, real
DeepSpeed 0.19.8 engines on CPU).

* **bnb AdamW8bit, ZeRO-2** on a small Llama (transformers ``LlamaForCausalLM``, config built in code,
  one parameter group): in every round each engine builds a fresh model (same seed) and optimizer and
  trains ``warmup + steps`` steps on the same batches; the engines alternate (which goes first flips
  every round). A ``dist.barrier()`` precedes every timed step; a step's time is the slowest rank's
  forward + ``engine.backward`` + ``engine.step``. Reported: median step time of each engine over all
  timed steps of all rounds and their ratio (hooked / stock; target <= 1.05), and the padding of the
  flat buffer (``W * S`` minus the parameters' elements) of each engine in bytes of the parameter dtype.
* **Muon, ZeRO-2** on a stack of bias-free matrices (Llama-like 256 x 688 / 688 x 256 MLP weights,
  plus an odd 300 x 37): stock is DeepSpeed's own Muon (``"optimizer": {"type": "Muon"}``,
  ``MuonWithAuxAdam``), whose ZeRO-1/2 path keeps a momentum buffer covering every parameter that
  touches a rank's partition (whole matrices, also those split across partitions); hooked is
  ``torch.optim.Muon`` with ``"semantics": "matrix"`` (whole matrices per partition, momentum on the
  owning rank only). Reported: momentum bytes per rank after 2 steps, against ``total / W``.
* **bnb AdamW8bit, ZeRO-3** on the same Llama (``"stage": 3``, ``stage3_param_persistence_threshold:
  0`` so every parameter is partitioned, ``reduce_bucket_size`` 2**20 instead of DeepSpeed's 5e8
  elements, no clipping): stock is ``deepspeed.initialize``, hooked is owner-compute on runs
  ([Note: ZeRO-3 owner-compute] in ``integrations/deepspeed/_stage3.py``); rounds, alternation and
  step times as for ZeRO-2. Reported: median step times and their ratio (target <= 1.10); the bytes
  each rank sent per optimizer step for owner-compute (``owner_traffic()["bytes_per_step"]``) next to
  the parameter bytes (4 * numel); the fp32 master elements each rank owner-computes (its runs).
* **Peak memory, ZeRO-3**: per rank, a fresh engine of each kind is built inside torch's profiler
  (allocator events, frees on every thread counted: ``engine_vs_fsdp2._track_cpu_allocations`` and
  ``_memory``), takes ``max(1, warmup)`` steps, then one marked step: peak, live bytes at the step's
  start, transient (peak minus start), all relative to the total before the model is built, and
  the ratio of peaks hooked / stock (target <= 1.05).
* **torch.optim.Muon, ZeRO-3** on the matrices: stock raises (its error is recorded); hooked steps
  whole matrices on owners. Reported: momentum bytes per rank against ``total / W``, bytes per step.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
from _common import add_output_args, command, emit, machine_facts, parser  # benchmarks/ is on sys.path
from torch import nn

LLAMA = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
SEQ, BATCH = 64, 4
# DeepSpeed's default ZeRO-3 reduce bucket is 5e8 elements (a 2 GB fp32 buffer on every rank, 150 times
# the small Llama): sized to the model instead, so the peak-memory ratio measures the engines.
Z3_BUCKET = {"reduce_bucket_size": 2**20}
# Llama-like projections of 2 layers (q, k, v, o, gate, up, down) and an odd 300 x 37 head: sizes that
# do not divide evenly, so stock partition boundaries fall inside matrices.
MUON_SHAPES = [(256, 256), (128, 256), (128, 256), (256, 256), (688, 256), (688, 256), (256, 688)] * 2 + [(300, 37)]


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **LLAMA,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation="eager",
        dtype=torch.float32,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).to(torch.float32).train()


class _Matrices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.w = nn.ParameterList([nn.Parameter(torch.randn(*s) / s[1] ** 0.5) for s in MUON_SHAPES])

    def forward(self, x):
        for i in range(0, len(self.w) - 1, 7):
            q, k, v, o, gate, up, down = self.w[i : i + 7]
            h = torch.tanh(x @ q.T) + torch.tanh(x @ k.T).repeat(1, 2) * torch.tanh(x @ v.T).repeat(1, 2)
            x = x + torch.tanh(h @ o.T)
            x = x + (nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
        return x[:, :37] @ self.w[-1].T


def _tokens(n: int):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, LLAMA["vocab_size"], (BATCH, SEQ), generator=gen) for _ in range(n)]


def _setup(rank: int, world_size: int) -> None:
    os.environ.update(
        DS_ACCELERATOR="cpu",
        LOCAL_RANK=str(rank),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import logging

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def _config(hooked: bool, semantics, extra=None, stage: int = 2) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if stage == 3:  # every parameter partitioned, as in a large model; no clipping (as the tests)
        cfg["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0, **Z3_BUCKET}
        cfg["gradient_clipping"] = 0
    if hooked:
        cfg["blockshard"] = {"semantics": semantics} if stage == 2 else {}
    cfg.update(extra or {})
    return cfg


def _padding(engine) -> dict:
    opt = engine.optimizer
    flat = sum(int(f.numel()) for f in opt.bit16_groups_flat)
    data = sum(int(p.numel()) for g in opt.bit16_groups for p in g)
    item = opt.bit16_groups_flat[0].element_size()
    return {
        "flat_numel": flat,
        "param_numel": data,
        "padding_numel": flat - data,
        "padding_bytes": (flat - data) * item,
        "padding_fraction": (flat - data) / flat,
        "segment_numel": int(opt.partition_size[0]),
    }


def _bnb_engine(hooked: bool, stage: int = 2):
    import bitsandbytes as bnb
    import deepspeed

    from blockshard.integrations import deepspeed as bsd

    model = _llama()
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    init = bsd.initialize if hooked else deepspeed.initialize
    engine, _, _, _ = init(model=model, optimizer=opt, config=_config(hooked, "bnb8bit", stage=stage))
    return engine


def _timed_steps(engine, data, warmup: int) -> list[float]:
    import torch.distributed as dist

    out = []
    for i, ids in enumerate(data):
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= warmup:
            out.append(float(dt))
    return out


def _momentum_bytes(inner) -> int:
    n = 0
    for st in inner.state.values():
        m = st.get("momentum_buffer") if isinstance(st, dict) else None
        if torch.is_tensor(m):
            n += m.numel() * m.element_size()
    return n


def _muon(hooked: bool) -> dict:
    import deepspeed

    from blockshard.integrations import deepspeed as bsd

    model = _Matrices()
    if hooked:
        engine, _, _, _ = bsd.initialize(
            model=model, optimizer=torch.optim.Muon(model.parameters(), lr=0.02), config=_config(True, "matrix")
        )
    else:
        extra = {"optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95}}}
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=_config(False, None, extra)
        )
    gen = torch.Generator().manual_seed(2)
    t = []
    for _ in range(2):
        x = torch.randn(BATCH, 256, generator=gen)
        t0 = time.perf_counter()
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        t.append(time.perf_counter() - t0)
    zo = engine.optimizer
    staged = sum(int(t.numel()) * t.element_size() for t, _ in getattr(zo, "_muon_pending_momentum", {}).values())
    return {
        "optimizer": type(engine.optimizer.optimizer).__name__,
        "staging_bytes": staged,
        "params_in_partition_numel": [sum(int(p.numel()) for p in g) for g in zo.params_in_partition],
        "momentum_bytes": _momentum_bytes(engine.optimizer.optimizer),
        "padding": _padding(engine),
        "last_step_s": t[-1],
    }


def _owned_numel(runs: dict, world_size: int) -> list[int]:
    """Elements of the fp32 master each rank owner-computes: ``owner_traffic()["runs"]`` summed by owner."""
    owned = [0] * world_size
    for param_runs in runs.values():
        for start, end, owner in param_runs:
            owned[owner] += end - start
    return owned


def _z3_memory(hooked: bool, data, warmup: int) -> dict:
    """Allocator totals of one timed step of a fresh ZeRO-3 engine, relative to the total before the
    model is built (``engine_vs_fsdp2._memory``; the caller turned on ``_track_cpu_allocations``)."""
    import gc

    import torch.distributed as dist
    from engine_vs_fsdp2 import _MARK, _memory
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()
    n = max(1, warmup)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.empty(1)  # an allocation event that fixes the baseline total
        engine = _bnb_engine(hooked, stage=3)
        _timed_steps(engine, data[:n], n)  # lazy state, prefetch order
        dist.barrier()
        with record_function(_MARK):
            _timed_steps(engine, data[n : n + 1], 0)
    memory = _memory(prof)
    del prof
    engine.destroy()
    return {k: memory[k] for k in ("peak", "at_step_start", "transient", "peak_at")}


def _muon_z3(hooked: bool) -> dict:
    """torch's Muon under ZeRO-3: hooked (owner-compute on whole matrices), or stock's error."""
    import deepspeed

    from blockshard.integrations import deepspeed as bsd

    model = _Matrices()
    opt = torch.optim.Muon(model.parameters(), lr=0.02)
    init = bsd.initialize if hooked else deepspeed.initialize
    gen = torch.Generator().manual_seed(2)
    engine, t = None, []
    try:
        engine, _, _, _ = init(model=model, optimizer=opt, config=_config(hooked, None, stage=3))
        for _ in range(2):
            x = torch.randn(BATCH, 256, generator=gen)
            t0 = time.perf_counter()
            engine.backward(engine(x).square().mean())
            engine.step()
            t.append(time.perf_counter() - t0)
    except Exception as e:  # stock ZeRO-3 hands torch's Muon a 1-D flat partition (at the first step)
        if engine is not None:
            engine.destroy()
        if hooked:
            raise
        return {"error": f"{type(e).__name__}: {e}"}
    traffic = engine.optimizer.owner_traffic()
    out = {
        "momentum_bytes": _momentum_bytes(engine.optimizer.optimizer),
        "bytes_per_step": traffic["bytes_per_step"],
        "runs": traffic["runs"],
        "last_step_s": t[-1],
    }
    engine.destroy()
    return out


def _zero3(data, rounds: int, warmup: int) -> dict:
    """bnb AdamW8bit under ZeRO-3, stock vs hooked (alternating per round), then memory and Muon."""
    from engine_vs_fsdp2 import _track_cpu_allocations

    times: dict[str, list[float]] = {"stock": [], "hooked": []}
    traffic = None
    for r in range(rounds):
        for name in ("stock", "hooked") if r % 2 == 0 else ("hooked", "stock"):
            engine = _bnb_engine(name == "hooked", stage=3)
            times[name] += _timed_steps(engine, data, warmup)
            if name == "hooked" and traffic is None:
                traffic = engine.optimizer.owner_traffic()
            engine.destroy()
            del engine
    _track_cpu_allocations()
    memory = {name: _z3_memory(name == "hooked", data, warmup) for name in ("stock", "hooked")}
    return {
        "times": times,
        "traffic": traffic,
        "memory": memory,
        "muon": {n: _muon_z3(n == "hooked") for n in ("stock", "hooked")},
    }


def _rank(rank: int, world_size: int, rounds: int, steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    _setup(rank, world_size)
    from blockshard.integrations import deepspeed as bsd

    data = _tokens(warmup + steps)
    times = {"stock": [], "hooked": []}
    padding, layout = {}, None
    for r in range(rounds):
        order = ("stock", "hooked") if r % 2 == 0 else ("hooked", "stock")
        for name in order:
            engine = _bnb_engine(name == "hooked")
            times[name] += _timed_steps(engine, data, warmup)
            padding[name] = _padding(engine)
            if name == "hooked" and layout is None:
                layout = bsd.layout_report(engine)
            del engine
    muon = {"stock": _muon(False), "hooked": _muon(True)}
    return {
        "zero3": _zero3(data, rounds, warmup),
        "times": times,
        "padding": padding,
        "muon": muon,
        "num_params": sum(p.numel() for p in _llama().parameters()),
        "layout_names": layout[0]["names"] if layout else None,
    }


def _parser():
    p = parser(__doc__, world_size=None, steps=8, warmup=2)
    p.add_argument("--world-size", type=int, nargs="+", default=[2], help="one run per world size")
    p.add_argument("--rounds", type=int, default=4)
    return add_output_args(p, timeout=None)


def _zero3_summary(res: list[dict], w: int) -> dict:
    z = [res[r]["zero3"] for r in range(w)]
    med = {k: statistics.median(v) for k, v in z[0]["times"].items()}
    num_params = res[0]["num_params"]
    sent = [z[r]["traffic"]["bytes_per_step"] for r in range(w)]
    runs = z[0]["traffic"]["runs"]
    memory = {}
    for name in ("stock", "hooked"):
        memory[name] = {k: [z[r]["memory"][name][k] for r in range(w)] for k in ("peak", "at_step_start", "transient")}
        memory[name]["peak_at_rank0"] = z[0]["memory"][name]["peak_at"]
    peak_ratio = [h / s for h, s in zip(memory["hooked"]["peak"], memory["stock"]["peak"], strict=True)]
    muon_total = 4 * sum(a * b for a, b in MUON_SHAPES)
    hm = [z[r]["muon"]["hooked"] for r in range(w)]
    momentum = [m["momentum_bytes"] for m in hm]
    return {
        "bnb_adamw8bit_zero3": {
            "config": {"stage": 3, "stage3_param_persistence_threshold": 0, **Z3_BUCKET, "gradient_clipping": 0},
            "median_step_s": med,
            "step_time_ratio_hooked_over_stock": med["hooked"] / med["stock"],
            "step_time_target": 1.10,
            "step_times_s": z[0]["times"],
            "param_bytes": 4 * num_params,
            "owner_compute_bytes_per_step_per_rank": sent,
            "bytes_per_step_rank0": sent[0][-1],
            "bytes_per_step_max_over_ranks": max(b for per_rank in sent for b in per_rank),
            "bytes_per_step_max_over_param_bytes": max(b for per_rank in sent for b in per_rank) / (4 * num_params),
            "num_runs": sum(len(v) for v in runs.values()),
            "owned_numel_per_rank": _owned_numel(runs, w),
            "num_params_div_w": num_params / w,
            "peak_memory_bytes": memory,
            "peak_ratio_hooked_over_stock_per_rank": peak_ratio,
            "peak_ratio_max": max(peak_ratio),
            "peak_ratio_target": 1.05,
            "memory_measured": "torch profiler allocator events (engine_vs_fsdp2._memory), one step after "
            "max(1, warmup) steps of a fresh engine, relative to the total before the model is built",
        },
        "muon_zero3": {
            "shapes": MUON_SHAPES,
            "stock": z[0]["muon"]["stock"],
            "hooked": {
                "optimizer": "Muon",
                "momentum_total_bytes": muon_total,
                "momentum_total_div_w_bytes": muon_total / w,
                "momentum_bytes_per_rank": momentum,
                "max_momentum_over_total_div_w": max(momentum) / (muon_total / w),
                "owned_numel_per_rank": _owned_numel(hm[0]["runs"], w),
                "bytes_per_step_per_rank": [m["bytes_per_step"] for m in hm],
                "param_bytes": muon_total,
                "last_step_s_rank0": hm[0]["last_step_s"],
            },
        },
    }


def _one(w: int, args) -> dict:
    from blockshard._launch import spawn_gloo

    load_before = list(os.getloadavg())
    t0 = time.perf_counter()
    res = spawn_gloo(_rank, w, args=(args.rounds, args.steps, args.warmup), timeout=1800)
    wall = time.perf_counter() - t0
    r0 = res[0]
    med = {k: statistics.median(v) for k, v in r0["times"].items()}
    muon_total = 4 * sum(a * b for a, b in MUON_SHAPES)
    muon = {}
    for name in ("stock", "hooked"):
        per_rank = [res[r]["muon"][name]["momentum_bytes"] for r in range(w)]
        staging = [res[r]["muon"][name]["staging_bytes"] for r in range(w)]
        muon[name] = {
            "optimizer": r0["muon"][name]["optimizer"],
            "momentum_bytes_per_rank": per_rank,
            "max_momentum_over_total_div_w": max(per_rank) / (muon_total / w),
            "staging_bytes_per_rank": staging,
            "max_momentum_plus_staging_over_total_div_w": max(m + st for m, st in zip(per_rank, staging, strict=True))
            / (muon_total / w),
            "last_step_s_rank0": r0["muon"][name]["last_step_s"],
            "padding": r0["muon"][name]["padding"],
        }
    return {
        "world_size": w,
        "loadavg_1_5_15_before": load_before,
        "bnb_adamw8bit_zero2": {
            "model": {
                **LLAMA,
                "seq_len": SEQ,
                "batch_size": BATCH,
                "num_params": r0["num_params"],
                "architecture": "transformers LlamaForCausalLM (eager attention, fp32, untied head)",
            },
            "semantics": "bnb8bit",
            "median_step_s": med,
            "step_time_ratio_hooked_over_stock": med["hooked"] / med["stock"],
            "step_time_target": 1.05,
            "step_times_s": r0["times"],
            "padding": r0["padding"],
        },
        "muon_zero2": {
            "shapes": MUON_SHAPES,
            "momentum_total_bytes": muon_total,
            "momentum_total_div_w_bytes": muon_total / w,
            **muon,
        },
        **_zero3_summary(res, w),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    import deepspeed

    report = {
        "benchmark": "deepspeed_hook",
        "command": command("deepspeed_hook.py", argv),
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "machine": machine_facts(versions={"deepspeed": deepspeed.__version__}),
        "runs": [_one(w, args) for w in args.world_size],
    }
    return emit(report, render=None, out=args.out, as_json=args.json)


if __name__ == "__main__":
    main()
