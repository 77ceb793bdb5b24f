"""Stock DeepSpeed ZeRO-2 against blockshard-hooked ZeRO-2 in one run: padding, step time, Muon momentum.

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


def _config(hooked: bool, semantics, extra=None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if hooked:
        cfg["blockshard"] = {"semantics": semantics}
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


def _bnb_engine(hooked: bool):
    import bitsandbytes as bnb
    import deepspeed

    from blockshard.integrations import deepspeed as bsd

    model = _llama()
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    init = bsd.initialize if hooked else deepspeed.initialize
    engine, _, _, _ = init(model=model, optimizer=opt, config=_config(hooked, "bnb8bit"))
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
