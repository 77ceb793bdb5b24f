"""ZeRO-3 runs for tests/integrations/test_deepspeed_zero3.py (top-level functions for spawned ranks).

One spawn per world size runs every case with real DeepSpeed ZeRO-3 engines (one after the other
in the same gloo group; ``stage3_param_persistence_threshold: 0`` so every parameter is
partitioned, as in a large model) and, on rank 0, the one-process references (plain torch, the
same optimizer over the model's parameters, the same micro-batches). Every rank gets the whole
batch, so the data-parallel average is every rank's own gradient exactly.
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import _ds_runs as base
import torch
from torch import nn

STEPS = 3
LR = {"adamw": 1e-2, "bnb": 1e-2, "ao8bit": 1e-2, "muon": 0.02, "shampoo": 1e-2, "muon_adamw": 0.02}
KINDS = tuple(LR)


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    params = list(params)
    if kind == "dsmuon":  # DeepSpeed's own Muon on one process: its Muon update on whole matrices
        from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

        return MuonWithAuxAdam([{"params": params, "use_muon": True, "lr": LR["muon"]}])
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=LR[kind])
    if kind == "bnb":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=LR[kind])
    if kind == "ao8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=LR[kind])
    if kind == "muon":
        return torch.optim.Muon(params, lr=LR[kind])
    if kind == "muon_adamw":  # blockshard.optim.MuonWithAdamW: Muon on the matrices, AdamW on the biases
        from blockshard.optim import MuonWithAdamW

        mats = [p for p in params if len(getattr(p, "ds_shape", p.shape)) == 2]  # zero.Init: 1-D placeholders
        rest = [p for p in params if len(getattr(p, "ds_shape", p.shape)) != 2]
        groups = [{"params": mats, "use_muon": True}, {"params": rest, "use_muon": False}]
        return MuonWithAdamW(groups, muon={"lr": LR[kind]}, adamw={"lr": LR["adamw"]})
    if kind == "shampoo":
        from blockshard.optim import BlockedShampoo

        return BlockedShampoo(params, lr=LR[kind], max_preconditioner_dim=32)
    raise ValueError(kind)


MODELS = ("", "unused", "lora")


def make_model(kind: str, model: str = "") -> nn.Module:
    """``kind``'s model (Muon's: matrices only); ``model``: ``"unused"`` (:class:`Unused`), ``"lora"``
    (peft LoRA adapters of rank 4 on every Linear of ``MatrixMLP``, the base weights frozen)."""
    if model == "lora":
        from peft import LoraConfig, get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(2)  # the adapters' A matrices are drawn at random (B starts at zero)
            cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["fc1", "fc2", "fc3", "fc4", "head"])
            return get_peft_model(base.MatrixMLP(), cfg)
    body = base.MatrixMLP() if kind in ("muon", "dsmuon") else base.BlockMLP()
    return Unused(body, bias=kind != "muon") if model == "unused" else body


class Unused(nn.Module):
    """``body`` with two layers some steps leave without a gradient: ``spare`` (64 x 64, on the
    input, used when :func:`spare_used` says so) and ``never`` (100 x 100, never used; 10100
    elements, cut into runs by bitsandbytes' semantics at W = 2)."""

    def __init__(self, body: nn.Module, bias: bool) -> None:
        super().__init__()
        self.body = body
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            self.spare = nn.Linear(64, 64, bias=bias)
            self.never = nn.Linear(100, 100, bias=bias)
        self.use_spare = True

    def forward(self, x):
        return self.body(x + self.spare(x) if self.use_spare else x)


def spare_used(step: int, micro: int, gas: int) -> bool:
    """Whether step ``step``'s micro-batch ``micro`` uses ``Unused.spare``: all of step 0, none of
    step 1 (stock DeepSpeed steps its stale step-0 gradient partition again), the last micro-batch
    of step 2 (stock adds the new gradient to the stale one under gradient accumulation)."""
    return step == 0 or (step == 2 and micro == gas - 1)


def config(gas: int = 1, stock: bool = False, batch: int = 12, clip: float = 0.0) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": batch // gas,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if not stock:
        cfg["blockshard"] = {}
    return cfg


def _micro(gas: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each step's batch cut into ``gas`` micro-batches."""
    out = []
    for x, y in base.batches(STEPS):
        b = x.shape[0] // gas
        out.append([(x[k * b : (k + 1) * b], y[k * b : (k + 1) * b]) for k in range(gas)])
    return out


def _trainable(model: nn.Module, frozen: bool) -> list[nn.Parameter]:
    """``frozen``: ``fc1`` does not train (its parameters stay out of the optimizer)."""
    if frozen:
        model.fc1.requires_grad_(False)
    return [p for p in model.parameters() if p.requires_grad]


def reference(
    kind: str,
    gas: int = 1,
    clip: float = 0.0,
    frozen: bool = False,
    bf16: bool = False,
    steps: int = STEPS,
    model_kind: str = "",
) -> list[torch.Tensor]:
    """One process: each micro-batch's loss / gas backward (as DeepSpeed scales it), torch's
    ``clip_grad_norm_`` (``clip``), then a step; ``bf16``: the model in bfloat16 over fp32 master
    weights (what DeepSpeed's ``"bf16"`` keeps), the optimizer on the masters."""
    if bf16:
        return _reference_bf16(kind)
    model = make_model(kind, model_kind)
    opt = make_optimizer(kind, _trainable(model, frozen))
    with _eager(kind == "dsmuon"):
        for s, micro in enumerate(_micro(gas)[:steps]):
            for k, (x, y) in enumerate(micro):
                if model_kind == "unused":
                    model.use_spare = spare_used(s, k, gas)
                (base._loss(model, x, y) / gas).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _eager(on: bool):
    """DeepSpeed's Muon update is ``torch.compile``d; eager (the same on both sides) saves the
    spawn the seconds compiling takes on CPU."""
    return torch.compiler.set_stance("force_eager") if on else contextlib.nullcontext()


def _reference_bf16(kind: str) -> list[torch.Tensor]:
    model = make_model(kind).to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    opt = make_optimizer(kind, masters)
    for micro in _micro(1):
        for x, y in micro:
            base._loss(model, x.to(torch.bfloat16), y.to(torch.bfloat16)).backward()
        for m, p in zip(masters, model.parameters(), strict=True):
            m.grad, p.grad = p.grad.float(), None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters(), strict=True):
                p.copy_(m)
    return [p.detach().clone() for p in model.parameters()]


def ref_key(kind: str, kw: dict) -> tuple:
    """The reference a case compares with: ``(kind, gas, clip, frozen, bf16)``, then ``(STEPS, model)``
    for another model than ``kind``'s plain one; DeepSpeed's own Muon (``ds_muon``): ``"dsmuon"``."""
    kind = "dsmuon" if kw.get("ds_muon") else kind
    key = (kind, kw.get("gas", 1), kw.get("clip", 0.0), kw.get("frozen", False), kw.get("bf16", False))
    return (*key, STEPS, kw["model"]) if kw.get("model") else key


def train(
    kind: str,
    *,
    gas: int = 1,
    zero_init: bool = False,
    stock: bool = False,
    clip: float = 0.0,
    frozen: bool = False,
    bf16: bool = False,
    model: str = "",
    ds_muon: bool = False,
    sub_group: int = 0,
    stage: int = 3,
    unused: str = "",
    owner: str = "",
) -> dict:
    """A ZeRO-3 engine (hooked unless ``stock``) trained on the whole batch; the full parameters
    and the hook's owner traffic. ``model``: see :func:`make_model`. ``ds_muon``: stock DeepSpeed
    with its own Muon (``"optimizer": {"type": "Muon"}``; DeepSpeed tags every matrix ``use_muon``;
    it refuses ``reduce_scatter`` with Muon). ``sub_group``: DeepSpeed's ``sub_group_size`` (elements;
    smaller than the model, so the optimizer steps several sub-groups of one ``param_group``).
    ``stage`` 1 or 2: ZeRO-1/2 instead (the hook with ``kind``'s semantics, ``_ds_runs.SEMANTICS``).
    ``unused``: the section's ``"unused_parameters"``; ``owner``: its ``"owner_compute"``."""
    import deepspeed

    from blockshard.integrations import deepspeed as bsd

    cfg = config(gas, stock, clip=clip)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if sub_group:
        cfg["zero_optimization"]["sub_group_size"] = sub_group
    if stage != 3:
        cfg["zero_optimization"] = {"stage": stage}
        if not stock and base.SEMANTICS[kind] is not None:
            cfg["blockshard"]["semantics"] = base.SEMANTICS[kind]
    if unused:
        cfg["blockshard"]["unused_parameters"] = unused
    if owner:
        cfg["blockshard"]["owner_compute"] = owner
    if ds_muon:
        cfg["optimizer"] = {"type": "Muon", "params": {"lr": LR["muon"]}}
        cfg["zero_optimization"]["reduce_scatter"] = False
    dtype = torch.bfloat16 if bf16 else torch.float32
    ctx = deepspeed.zero.Init(config_dict_or_path=cfg) if zero_init else contextlib.nullcontext()
    with ctx:
        net = make_model(kind, model)
    if zero_init:
        assert all(p.numel() == 0 for p in net.parameters())  # partitioned at construction
    if ds_muon:
        opt = None
    elif zero_init:  # torch's Muon checks shapes at construction: zero.Init's placeholders are 1-D
        opt = bsd.zero3_optimizer(lambda ps: make_optimizer(kind, ps), _trainable(net, frozen))
    else:
        opt = make_optimizer(kind, _trainable(net, frozen))
    init = deepspeed.initialize if stock else bsd.initialize
    extra = {"model_parameters": list(net.parameters())} if ds_muon else {}
    engine, _, _, _ = init(model=net, optimizer=opt, config=cfg, **extra)
    with _eager(ds_muon):
        for s, micro in enumerate(_micro(gas)):
            for k, (x, y) in enumerate(micro):
                if model == "unused":
                    net.use_spare = spare_used(s, k, gas)
                engine.backward(base._loss(engine, x.to(dtype), y.to(dtype)))
                engine.step()
    params = list(net.parameters())
    if stage != 3:  # ZeRO-1/2 keep every parameter whole
        out: dict = {"params": [p.detach().clone() for p in params]}
        engine.destroy()
        return out
    assert all(p.numel() == 0 for p in params)  # every parameter partitioned (nothing persistent)
    with deepspeed.zero.GatheredParameters(params):
        full = [p.detach().clone() for p in params]
    out = {"params": full}
    if not stock:
        out["traffic"] = engine.optimizer.owner_traffic()
        out["subgroups"] = len(engine.optimizer.fp16_groups)
    engine.destroy()
    return out


def _engine(kind: str, cfg: dict, optimizer: str | None = None):
    """A hooked engine on ``kind``'s model with ``optimizer`` (default: ``kind``'s)."""
    from blockshard.integrations import deepspeed as bsd

    model = make_model(kind)
    opt = make_optimizer(optimizer or kind, model.parameters())
    engine, _, _, _ = bsd.initialize(model=model, optimizer=opt, config=cfg)
    return model, engine


def _full(model) -> list[torch.Tensor]:
    import deepspeed

    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def checkpoint(kind: str, ckpt_dir: str) -> dict:
    """Two steps, ``save_checkpoint``, one more step (``a``); a new engine loads the checkpoint and
    takes that step (``b``); an engine with an element-wise optimizer must refuse the checkpoint."""
    cfg = config()
    steps = _micro(1)
    model, engine = _engine(kind, cfg)
    for k, micro in enumerate(steps):
        if k == 2:
            engine.save_checkpoint(ckpt_dir, tag="t2")
        for x, y in micro:
            engine.backward(base._loss(engine, x, y))
            engine.step()
    a = _full(model)
    engine.destroy()
    model2, engine2 = _engine(kind, cfg)
    engine2.load_checkpoint(ckpt_dir, tag="t2")
    for x, y in steps[2]:
        engine2.backward(base._loss(engine2, x, y))
        engine2.step()
    b = _full(model2)
    engine2.destroy()
    _, engine3 = _engine(kind, cfg, optimizer="adamw")
    try:
        engine3.load_checkpoint(ckpt_dir, tag="t2")
        mismatch = "no error"
    except Exception as e:  # the test reads the message
        mismatch = f"{type(e).__name__}: {e}"
    engine3.destroy()
    return {"a": a, "b": b, "mismatch": mismatch}


def resume_world(rank: int, world_size: int, dirs: dict[str, str]) -> dict:
    """A spawned rank: for each ``kind: checkpoint_dir`` (saved after 2 steps, resharded for this
    world size), a new hooked engine loads it and takes the third step; the full parameters
    (``"stock"``: a save of another world size loaded as it is; the error; ``"dcp_<kind>"``: a DCP
    export of such a save, imported with ``import_dcp``, ``"dcp_<kind>_model_only"`` without its
    optimizer state)."""
    base.setup_env(rank, world_size)
    out: dict = {}
    for kind, d in dirs.items():
        if kind == "stock":  # the control: the save of another world size, as it is
            _, engine = _engine("bnb", config())
            try:
                engine.load_checkpoint(d, tag="t2")
                out[kind] = "no error"
            except Exception as e:  # DeepSpeed's ZeRORuntimeException
                out[kind] = f"{type(e).__name__}: {e}"
            engine.destroy()
            continue
        if kind.startswith("dcp_"):  # a DCP export of a save at another world size: import_dcp
            from blockshard.integrations.deepspeed import import_dcp

            model, engine = _engine(kind.split("_")[1], config())
            import_dcp(engine, d, optimizer_state=not kind.endswith("_model_only"))
        else:
            model, engine = _engine(kind, config())
            engine.load_checkpoint(d)
        for x, y in _micro(1)[2]:
            engine.backward(base._loss(engine, x, y))
            engine.step()
        out[kind] = _full(model)
        engine.destroy()
    return out


def error(what: str) -> str:
    """What a refused setup raises (the message), or "no error"."""
    from blockshard.integrations import deepspeed as bsd

    cfg = config()
    if what == "offload":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False
    model = make_model("muon" if what in ("blockshard_muon", "parts") else "bnb")
    if what == "blockshard_muon":  # blockshard's own owner-compute Muon (for fully_shard / FSDP2)
        from blockshard.optim import Muon

        opt = Muon(model.named_parameters(), lr=LR["muon"])
    elif what == "parts":  # a fused weight's parts: honoured by blockshard.optim.Muon only
        cfg["blockshard"] = {"semantics": "matrix,fc2.weight=parts:65:65"}
        opt = make_optimizer("muon", model.parameters())
    else:
        opt = make_optimizer("bnb", model.parameters())
    try:
        bsd.initialize(model=model, optimizer=opt, config=cfg)
    except Exception as e:  # the test reads the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def run_cases(rank: int, spec: dict) -> dict:
    """In a spawned rank that ran ``_ds_runs.setup_env`` (``_ds_runs.run_world`` calls this with
    its spec's ``zero3``): ``cases`` {name: (kind, kwargs of :func:`train`)}, ``refs`` [:func:`ref_key`]
    (rank 0), ``errors`` [what], ``ckpt`` [kind] (in the directory ``tmp``)."""
    out: dict = {"cases": {}, "refs": {}, "errors": {}}
    for name, (kind, kw) in spec.get("cases", {}).items():
        try:
            out["cases"][name] = train(kind, **kw)
        except Exception as e:  # a refused stock setup (torch's Muon on DeepSpeed's flat partition)
            out["cases"][name] = {"error": f"{type(e).__name__}: {e}"}
    for what in spec.get("errors", []):
        out["errors"][what] = error(what)
    for kind in spec.get("ckpt", []):
        d = os.path.join(spec["tmp"], f"z3-{kind}")
        out.setdefault("ckpt", {})[kind] = checkpoint(kind, d)
        out.setdefault("ckpt_dirs", {})[kind] = d
    if rank == 0:
        with torch.random.fork_rng(devices=[]):
            for key in spec.get("refs", []):
                out["refs"][key] = reference(*key)
    return out
