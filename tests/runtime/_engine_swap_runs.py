"""Checkpoints that move between stock FSDP2 (``torch.distributed.fsdp.fully_shard``) and blockshard
(issue 28, item 4): written with torch's ``get_state_dict`` + ``dcp.save`` by one engine at one W,
read with ``dcp.load`` + ``set_state_dict`` by the other at another W, then trained on. Every
function takes ``(rank, world, ...)``; every rank sees the whole batch (bitwise at W in {2, 4}).

Layouts: ``dcp`` ({"model": ..., "optim": ...}, as torch's docs) and ``titan`` (torchtitan's
checkpointer: the model's keys at the top level, ``"optimizer"`` flattened with
``flatten_optimizer_state_dict=True``, ``"train_state"``). Stock FSDP2 runs with blockshard's torch
routes uninstalled (torch's own helpers), as in a process that never imported blockshard.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

import blockshard

STEPS_BEFORE, STEPS = 2, 4
LAYOUTS = ("dcp", "titan")
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
FULL = StateDictOptions(full_state_dict=True)


# -- the model: two blocks and a root group, a tied embedding / head of 23 x 12 -----------------
class Block(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.norm, self.qkv = nn.LayerNorm(d), nn.Linear(d, 3 * d)
        self.up, self.down = nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, -1)
        x = x + torch.softmax(q @ k.transpose(-1, -2) / 3.0, -1) @ v
        return x + self.down(nn.functional.gelu(self.up(x)))


class TinyLM(nn.Module):
    """Embedding 23 x 12 tied to the head (FSDP2 cuts it 6/6/6/5 rows at W = 4; blockshard's pieces
    are flat runs of another size), blocks with 36 x 12 and 20 x 12 weights."""

    def __init__(self, seed: int, vocab: int = 23, d: int = 12, f: int = 20) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList([Block(d, f) for _ in range(2)])
            self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def build(engine: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    m = TinyLM(seed)
    if engine == "stock":
        from torch.distributed.fsdp import fully_shard

        blockshard.uninstall_torch_routes()  # torch's own helpers from here (fully_shard installs them again)
        for b in m.blocks:
            fully_shard(b)
        fully_shard(m)
    elif engine == "blockshard":
        for b in m.blocks:
            blockshard.fully_shard(b)
        blockshard.fully_shard(m)
    return m, torch.optim.AdamW(m.parameters(), lr=0.05)


def train(m: nn.Module, o: torch.optim.Optimizer, steps: range) -> None:
    for i in steps:
        ids = (torch.arange(15) * (i + 2) + i).remainder(23).view(3, 5)
        nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten()).backward()
        o.step()
        o.zero_grad()


def values(m: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters by name, on every rank (torch's full state dict: DTensors or blockshard's)."""
    return {k: v.detach().clone() for k, v in get_model_state_dict(m, options=FULL).items()}


def _states(layout: str, m: nn.Module, o: torch.optim.Optimizer) -> dict:
    if layout == "dcp":
        msd, osd = get_state_dict(m, o)
        return {"model": msd, "optim": osd}
    return {**get_model_state_dict(m), "optimizer": get_optimizer_state_dict(m, o, options=FLAT), "train_state": {}}


def _set(layout: str, m: nn.Module, o: torch.optim.Optimizer, state: dict) -> None:
    if layout == "dcp":
        set_state_dict(m, o, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return
    model = {k: v for k, v in state.items() if k not in ("optimizer", "train_state")}
    set_model_state_dict(m, model, options=StateDictOptions(strict=False))  # torchtitan's ModelWrapper
    set_optimizer_state_dict(m, o, state["optimizer"], options=FLAT)  # torchtitan's OptimizersContainer


# -- runs ---------------------------------------------------------------------------------------
def reference(rank: int, world: int) -> dict:
    """One process, never switched; and the bitsandbytes -> AdamW conversion on one process."""
    m, o = build("none", 0)
    train(m, o, range(STEPS))
    return {"final": {k: v.detach().clone() for k, v in m.state_dict().items()}, "bnb": bnb_reference()}


def save(rank: int, world: int, path: str, engine: str) -> dict:
    """``engine`` at W = ``world``: train, save in both layouts, train on (the source continuing)."""
    m, o = build(engine, 0)
    train(m, o, range(STEPS_BEFORE))
    for layout in LAYOUTS:
        dcp.save(_states(layout, m, o), checkpoint_id=os.path.join(path, f"{engine}{world}-{layout}"))
    torch.save(o.state_dict(), os.path.join(path, f"{engine}{world}-raw-{rank}.pt"))  # per rank, for the control
    train(m, o, range(STEPS_BEFORE, STEPS))
    return {"final": values(m)}


def load(rank: int, world: int, path: str, engine: str, source: str) -> dict:
    """``engine`` at W = ``world`` resumes ``source``'s checkpoints in both layouts; the controls:
    the model without the optimizer state, and the source rank's raw ``optimizer.state_dict()``."""
    out: dict = {}
    for layout in LAYOUTS:
        m, o = build(engine, 1)
        state = _states(layout, m, o)
        dcp.load(state, checkpoint_id=os.path.join(path, f"{source}-{layout}"))
        _set(layout, m, o, state)
        train(m, o, range(STEPS_BEFORE, STEPS))
        out[layout] = values(m)
    m, o = build(engine, 1)
    state = {"model": get_model_state_dict(m)}
    dcp.load(state, checkpoint_id=os.path.join(path, f"{source}-dcp"))
    set_model_state_dict(m, state["model"])
    train(m, o, range(STEPS_BEFORE, STEPS))
    out["model_only"] = values(m)
    mine = rank % int(source[-1])  # a rank of the source's world: every rank takes the same path
    out["raw"] = _raw_control(engine, os.path.join(path, f"{source}-raw-{mine}.pt"))
    return out


def _raw_control(engine: str, file: str) -> str:
    """``optimizer.load_state_dict`` of the source rank's own state (ids, local pieces or DTensors), then a step."""
    m, o = build(engine, 1)
    try:
        o.load_state_dict(torch.load(file, weights_only=False))
        train(m, o, range(STEPS_BEFORE, STEPS))
    except Exception as e:  # the outcome is the result
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return "no error"


# -- bitsandbytes 8-bit state (item 4 b) ----------------------------------------------------------
class Wide(nn.Module):
    """Weights of 40 x 256 (8-bit state, 40 blocks of 256) and 5 x 40, biases (32-bit state)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.up, self.down = nn.Linear(256, 40), nn.Linear(40, 5)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def _wide_train(m: nn.Module, o: torch.optim.Optimizer, steps: range) -> None:
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 256, generator=g), torch.randn(8, 5, generator=g)) for _ in range(STEPS)]
    for i in steps:
        x, y = data[i]
        ((m(x) - y) ** 2).mean().backward()
        o.step()
        o.zero_grad()


def _bnb(m: nn.Module) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(m.parameters(), lr=1e-2)


def bnb_reference() -> dict:
    """One process: bitsandbytes AdamW8bit, its full state converted to AdamW's keys and checked
    against bitsandbytes' own dequantization, then torch's AdamW continuing from it."""
    import bitsandbytes.functional as F

    m = Wide(0)
    o = _bnb(m)
    _wide_train(m, o, range(STEPS_BEFORE))
    osd = get_optimizer_state_dict(m, o, options=FULL)
    quant = osd["state"]["up.weight"]["__bnb_optimizer_quant_state__"]
    oracle = F.dequantize_blockwise(quant["state1"], absmax=quant["absmax1"], code=quant["qmap1"], blocksize=256)
    converted = blockshard.stock_adamw_state_dict(osd)
    exact = torch.equal(oracle, converted["state"]["up.weight"]["exp_avg"])  # before AdamW steps on it in place
    adamw = torch.optim.AdamW(m.parameters(), lr=1e-2)
    set_optimizer_state_dict(m, adamw, converted, options=FULL)
    _wide_train(m, adamw, range(STEPS_BEFORE, STEPS))
    return {
        "oracle_equal": exact,
        "state1_dtype": str(quant["state1"].dtype),
        "final": {k: v.detach().clone() for k, v in m.state_dict().items()},
    }


def bnb_save(rank: int, world: int, path: str) -> None:
    """blockshard (``bnb8bit`` weights) + bitsandbytes AdamW8bit: the raw checkpoint and the converted one."""
    m = Wide(0)
    blockshard.fully_shard(m, semantics={"*weight": "bnb8bit", "*bias": "elementwise"})
    o = _bnb(m)
    _wide_train(m, o, range(STEPS_BEFORE))
    msd, osd = get_state_dict(m, o)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(path, "bnb-raw"))
    converted = blockshard.stock_adamw_state_dict(osd)
    dcp.save({"model": msd, "optim": converted}, checkpoint_id=os.path.join(path, "bnb-adamw"))
    full = get_optimizer_state_dict(m, o, options=FULL)  # collective
    if rank == 0:
        torch.save(full, os.path.join(path, "bnb-full.pt"))


def bnb_load_stock(rank: int, world: int, path: str) -> dict:
    """Stock FSDP2 + torch's AdamW reads blockshard's bitsandbytes checkpoints: the raw one (default
    planner; partial load), the converted one."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.fsdp import fully_shard

    blockshard.uninstall_torch_routes()

    def stock() -> tuple[nn.Module, torch.optim.Optimizer, dict]:
        m = fully_shard(Wide(1))
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        msd, osd = get_state_dict(m, o)
        return m, o, {"model": msd, "optim": osd}

    out: dict = {}
    m, o, state = stock()
    try:
        dcp.load(state, checkpoint_id=os.path.join(path, "bnb-raw"))
        out["raw"] = "no error"
    except CheckpointException as e:  # a BaseException
        out["raw"] = str(e)
    m, o, state = stock()
    dcp.load(state, checkpoint_id=os.path.join(path, "bnb-raw"), planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(m, o, model_state_dict=state["model"], optim_state_dict=state["optim"])
    held = o.state[m.up.weight]
    out["partial"] = {
        "step": float(held["step"]),
        "exp_avg_abs_max": float(held["exp_avg"].full_tensor().abs().max()),
    }
    _wide_train(m, o, range(STEPS_BEFORE, STEPS))
    out["partial_final"] = values(m)
    m, o, state = stock()
    try:  # blockshard's full state dict (bitsandbytes' layout, as an unsharded model's)
        full = torch.load(os.path.join(path, "bnb-full.pt"), weights_only=False)
        set_optimizer_state_dict(m, o, full, options=FULL)
        out["full"] = "no error"
    except Exception as e:
        out["full"] = f"{type(e).__name__}: {e}"
    m, o, state = stock()
    dcp.load(state, checkpoint_id=os.path.join(path, "bnb-adamw"))
    set_state_dict(m, o, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _wide_train(m, o, range(STEPS_BEFORE, STEPS))
    out["converted_final"] = values(m)
    return out


# -- Muon momentum (item 4 b): torch.optim.Muon on whole matrices, AdamW on the rest --------------
_MATRICES = ("qkv.weight", "up.weight", "down.weight")


def _muon(engine: str, seed: int) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    """blockshard places each block matrix whole on one rank (``matrix``, ``policy="whole"``), so
    unmodified ``torch.optim.Muon`` steps whole matrices; ranks leave out their empty pieces."""
    m = TinyLM(seed)
    if engine == "stock":
        from torch.distributed.fsdp import fully_shard

        blockshard.uninstall_torch_routes()
        for b in m.blocks:
            fully_shard(b)
        fully_shard(m)
    elif engine == "blockshard":
        rules = {f"*{k}": "matrix" for k in _MATRICES}
        for b in m.blocks:
            blockshard.fully_shard(b, semantics=rules, policy="whole")
        blockshard.fully_shard(m)
    named = [(n, p) for n, p in m.named_parameters() if p.numel() > 0]
    mats = [p for n, p in named if n.endswith(_MATRICES)]
    rest = [p for n, p in named if not n.endswith(_MATRICES)]
    return m, [torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW(rest, lr=0.01)]


class _Both:
    def __init__(self, opts: list[torch.optim.Optimizer]) -> None:
        self.opts = opts

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad()


def _muon_full_state(m: nn.Module, opts: list) -> dict:
    return {
        n: {k: v.detach().clone() for k, v in e.items() if isinstance(v, torch.Tensor)}
        for n, e in get_optimizer_state_dict(m, opts, options=FULL)["state"].items()
    }


def _muon_resume(engine: str, path: str) -> tuple[nn.Module, list]:
    m, opts = _muon(engine, 1)
    msd, osd = get_state_dict(m, opts)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(m, opts, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return m, opts


def muon_save(rank: int, world: int, path: str, engine: str) -> dict:
    """``engine`` trains with Muon + AdamW and saves; the full optimizer state as saved."""
    m, opts = _muon(engine, 0)
    train(m, _Both(opts), range(STEPS_BEFORE))  # type: ignore[arg-type]
    msd, osd = get_state_dict(m, opts)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(path, f"muon-{engine}{world}"))
    return {"state": _muon_full_state(m, opts)}


def muon_load(rank: int, world: int, path: str, engine: str, source: str) -> dict:
    """``engine`` resumes ``source``'s Muon checkpoint: the full optimizer state as loaded, and the run on."""
    m, opts = _muon_resume(engine, os.path.join(path, f"muon-{source}"))
    loaded = _muon_full_state(m, opts)
    train(m, _Both(opts), range(STEPS_BEFORE, STEPS))  # type: ignore[arg-type]
    final = values(m) if world > 1 else {k: v.detach().clone() for k, v in m.state_dict().items()}
    return {"state": loaded, "final": final}
