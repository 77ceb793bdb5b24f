"""Training runs for tests/integrations/test_deepspeed.py (top-level functions for spawned ranks).

One spawn per world size runs every scenario with real DeepSpeed engines (one engine after the
other in the same gloo group) and, on rank 0, the single-process references (plain torch, one
optimizer per parameter as a user would write it), since starting ranks that import DeepSpeed
dominates the test time. Every rank gets the whole batch unless ``split`` is set.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
from torch import nn

STEPS = 4
LR = {"bnb": 1e-2, "adamw": 1e-2, "muon": 0.02}


class BlockMLP(nn.Module):
    """Weights of 5696 (whole for bnb8bit: 4096 <= n < 8192), 11570 and 13000 elements (split-able),
    biases below 4096 (fp32 state in bitsandbytes on one process); no shape is a multiple of 256."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.fc1 = nn.Linear(64, 89)
            self.fc2 = nn.Linear(89, 130)
            self.fc3 = nn.Linear(130, 100)
            self.head = nn.Linear(100, 7)

    def forward(self, x):
        g = nn.functional.gelu
        return self.head(g(self.fc3(g(self.fc2(g(self.fc1(x)))))))


class MatrixMLP(nn.Module):
    """Bias-free: every parameter is a matrix (torch.optim.Muon takes only 2-D parameters)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.fc1 = nn.Linear(64, 89, bias=False)
            self.fc2 = nn.Linear(89, 130, bias=False)
            self.fc3 = nn.Linear(130, 100, bias=False)
            self.fc4 = nn.Linear(100, 37, bias=False)
            self.head = nn.Linear(37, 7, bias=False)

    def forward(self, x):
        g = nn.functional.gelu
        return self.head(g(self.fc4(g(self.fc3(g(self.fc2(g(self.fc1(x)))))))))


def batches(n: int = STEPS, batch: int = 12):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(batch, 64, generator=gen), torch.randn(batch, 7, generator=gen)) for _ in range(n)]


def make_optimizer(kind: str, params):
    params = list(params)
    if kind == "bnb":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=LR["bnb"])
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=LR["adamw"])
    if kind == "muon":
        return torch.optim.Muon(params, lr=LR["muon"])
    raise ValueError(kind)


def make_model(kind: str) -> nn.Module:
    return MatrixMLP() if kind == "muon" else BlockMLP()


SEMANTICS = {"bnb": {"*weight": "bnb8bit", "*bias": "bnb8bit"}, "adamw": None, "muon": "matrix", "muon_adamw": "matrix"}


def ds_config(stage: int, kind: str, *, hooked: bool = True, batch: int = 12, extra: dict | None = None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if hooked:
        cfg["blockshard"] = {"semantics": SEMANTICS[kind]} if SEMANTICS[kind] is not None else {}
    cfg.update(extra or {})
    return cfg


def setup_env(rank: int, world_size: int) -> None:
    """What the deepspeed/torchrun launchers set; spawn_gloo already made the gloo group."""
    os.environ.update(
        DS_ACCELERATOR="cpu",
        LOCAL_RANK=str(rank),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


def _loss(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def reference(kind: str, steps: int = STEPS) -> list[torch.Tensor]:
    """One process, no DeepSpeed: the optimizer over the model's parameters."""
    model = make_model(kind)
    opt = make_optimizer(kind, model.parameters())
    for x, y in batches(steps):
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _engine(stage: int, kind: str, hooked: bool, extra: dict | None = None):
    import deepspeed

    from blockshard.integrations import deepspeed as bsd

    model = make_model(kind)
    opt = make_optimizer(kind, model.parameters())
    init = bsd.initialize if hooked else deepspeed.initialize
    engine, _, _, _ = init(model=model, optimizer=opt, config=ds_config(stage, kind, hooked=hooked, extra=extra))
    return model, engine


def _train(engine, data, rank: int, world_size: int, split: bool) -> None:
    for x, y in data:
        if split:
            b = x.shape[0] // world_size
            x, y = x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]
        loss = _loss(engine, x, y)
        engine.backward(loss)
        engine.step()


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def train_case(
    rank: int, world_size: int, stage: int, kind: str, hooked: bool, split: bool = False, steps: int = STEPS
) -> dict:
    model, engine = _engine(stage, kind, hooked)
    _train(engine, batches(steps), rank, world_size, split)
    out = {"params": _params(model)}
    if hooked:
        import blockshard
        from blockshard.integrations import deepspeed as bsd

        out["layout"] = bsd.layout_report(engine)
        out["state_bytes"] = _state_bytes(engine.optimizer.optimizer)
        out["report"] = blockshard.report(engine, optimizers=[engine.optimizer])  # a collective: every rank
        out["counts"] = blockshard.collective_counts(engine)
        out["handed_numel"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        out["partition_bytes"] = [
            t.numel() * t.element_size() for t in engine.optimizer.single_partition_of_fp32_groups
        ]
    return out


def _state_bytes(opt) -> dict:
    """Bytes of optimizer state tensors on this rank, by state key."""
    out: dict[str, int] = {}
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0:
                out[k] = out.get(k, 0) + v.numel() * v.element_size()
    return out


def checkpoint_case(rank: int, world_size: int, stage: int, kind: str, ckpt_dir: str) -> dict:
    """Train 2 steps, save, train 2 more (A); a new engine loads and trains the same 2 (B): A == B.
    Then an engine with another layout (element-wise semantics) must refuse that checkpoint."""
    import torch.distributed as dist

    from blockshard.integrations import deepspeed as bsd

    data = batches(4)
    model, engine = _engine(stage, kind, True)
    _train(engine, data[:2], rank, world_size, False)
    engine.save_checkpoint(ckpt_dir, tag="t2")
    _train(engine, data[2:], rank, world_size, False)
    a = _params(model)
    model2, engine2 = _engine(stage, kind, True)
    engine2.load_checkpoint(ckpt_dir, tag="t2")
    _train(engine2, data[2:], rank, world_size, False)
    b = _params(model2)
    mismatch = ""
    if kind == "bnb":
        model3 = make_model(kind)
        cfg = ds_config(stage, kind)
        cfg["blockshard"] = {}  # element-wise: another layout
        engine3, _, _, _ = bsd.initialize(model=model3, optimizer=make_optimizer(kind, model3.parameters()), config=cfg)
        try:
            engine3.load_checkpoint(ckpt_dir, tag="t2")
        except bsd.DeepSpeedHookError as e:
            mismatch = str(e)
    dist.barrier()
    return {"a": a, "b": b, "mismatch": mismatch}


def error_case(rank: int, world_size: int, what: str) -> str:
    """Build an engine that the hook must refuse; return the error message ('' if none was raised)."""
    from blockshard.integrations import deepspeed as bsd

    try:
        if what == "muon_split":  # Muon without "matrix" semantics: matrices would be split
            model = make_model("muon")
            cfg = ds_config(2, "muon")
            cfg["blockshard"] = {}
            bsd.initialize(model=model, optimizer=make_optimizer("muon", model.parameters()), config=cfg)
        elif what == "bf16_zero1":  # bf16 ZeRO-1 + fp32 grad accumulation builds BF16_Optimizer: not hooked
            model = make_model("adamw").to(torch.bfloat16)
            cfg = ds_config(1, "adamw", extra={"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}})
            bsd.initialize(model=model, optimizer=make_optimizer("adamw", model.parameters()), config=cfg)
        elif what == "parts":  # a fused weight's parts: honoured by blockshard.optim.Muon only
            model = make_model("muon")
            cfg = ds_config(2, "muon")
            cfg["blockshard"] = {"semantics": "matrix,fc2.weight=parts:65:65"}
            bsd.initialize(model=model, optimizer=make_optimizer("muon", model.parameters()), config=cfg)
        else:
            raise ValueError(what)
    except bsd.DeepSpeedHookError as e:
        return str(e)
    return ""


# -- DeepSpeed options with bnb AdamW8bit (hooked ZeRO-2 against one process) -----------------------
VARIANTS = {  # name: (gradient_accumulation_steps, two param groups, zero_optimization overrides)
    "grad_accum_2": (2, False, {}),
    "two_param_groups": (1, True, {}),
    "round_robin_gradients": (1, False, {"round_robin_gradients": True}),
    "no_contiguous_gradients": (1, False, {"contiguous_gradients": False}),
    "overlap_comm": (1, False, {"overlap_comm": True}),
    "small_buckets": (1, False, {"reduce_bucket_size": 5000, "allgather_bucket_size": 6000}),
    "reduce_to_owners": (1, False, {"use_multi_rank_bucket_allreduce": False}),
}


def _bnb_groups(model, grouped: bool):
    if not grouped:
        return model.parameters()
    w = [p for n, p in model.named_parameters() if n.endswith("weight")]
    b = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": w, "weight_decay": 0.1}, {"params": b, "weight_decay": 0.0, "lr": 3e-3}]


def variant_reference(name: str) -> list[torch.Tensor]:
    import bitsandbytes as bnb

    ga, grouped, _ = VARIANTS[name]
    model = make_model("bnb")
    opt = bnb.optim.AdamW8bit(_bnb_groups(model, grouped), lr=LR["bnb"])
    data = batches(STEPS * ga)
    for s in range(STEPS):
        opt.zero_grad()
        for x, y in data[s * ga : (s + 1) * ga]:
            (_loss(model, x, y) / ga).backward()
        opt.step()
    return _params(model)


def variant_case(rank: int, world_size: int, name: str) -> dict:
    import bitsandbytes as bnb

    import blockshard
    from blockshard.integrations import deepspeed as bsd

    ga, grouped, zero = VARIANTS[name]
    model = make_model("bnb")
    opt = bnb.optim.AdamW8bit(_bnb_groups(model, grouped), lr=LR["bnb"])
    cfg = ds_config(2, "bnb")
    cfg["gradient_accumulation_steps"] = ga
    cfg["zero_optimization"].update(zero)
    engine, _, _, _ = bsd.initialize(model=model, optimizer=opt, config=cfg)
    _train(engine, batches(STEPS * ga), rank, world_size, False)
    return {
        "params": _params(model),
        "counts": blockshard.collective_counts(engine),
        "layout": bsd.layout_report(engine),
        "handed_numel": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def run_world(rank: int, world_size: int, spec: dict) -> dict:
    """``spec``: ``cases`` [(name, stage, kind, hooked, split)], ``ckpt`` [(stage, kind)], ``errors``
    [what], ``variants`` [name of VARIANTS], ``refs`` [kind] (references computed on rank 0),
    ``zero3`` (the spec of ``_ds_zero3_runs.run_cases``).
    Returns the same keys with results (and ``variant_refs`` on rank 0)."""
    setup_env(rank, world_size)
    out: dict = {"cases": {}, "ckpt": {}, "errors": {}, "refs": {}}
    for name, stage, kind, hooked, split in spec.get("cases", []):
        out["cases"][name] = train_case(rank, world_size, stage, kind, hooked, split)
    root = spec.get("tmp") or tempfile.gettempdir()
    for stage, kind in spec.get("ckpt", []):
        d = os.path.join(root, f"blockshard-ds-ckpt-w{world_size}-z{stage}-{kind}")
        out["ckpt"][(stage, kind)] = checkpoint_case(rank, world_size, stage, kind, d)
    for what in spec.get("errors", []):
        out["errors"][what] = error_case(rank, world_size, what)
    variants = {name: variant_case(rank, world_size, name) for name in spec.get("variants", [])}
    out["variants"] = {name: v["params"] for name, v in variants.items()}
    out["variant_counts"] = {
        name: {k: v[k] for k in ("counts", "layout", "handed_numel")} for name, v in variants.items()
    }
    if spec.get("zero3"):  # ZeRO-3 cases in the same ranks (starting ranks that import DeepSpeed dominates)
        import _ds_zero3_runs

        out["zero3"] = _ds_zero3_runs.run_cases(rank, spec["zero3"])
    if rank == 0:
        for kind in spec.get("refs", []):
            out["refs"][kind] = reference(kind)
        out["variant_refs"] = {name: variant_reference(name) for name in spec.get("variants", [])}
    return out
