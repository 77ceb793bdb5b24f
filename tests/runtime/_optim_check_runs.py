"""Scenarios of the first-step optimizer checks ([Note: first-step optimizer checks] in
blockshard/runtime/core/_optim_checks.py), each a tripping run and a control, run by every rank
(spawned ranks in test_optim_checks.py, thread ranks in test_fast_optim_checks.py).

Every rank gets the whole batch, so a control that passes is bitwise equal to one process
(:func:`reference`, the same model and steps unsharded); a tripping run must raise
``OptimizerSetupError`` (or ``ShardingError``) on every rank before its first step changes a value.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from _unchecked import unchecked
from torch import nn

import blockshard
from blockshard._tiny import text_batches, tiny_llama

STEPS = 3


def _llama(shard: bool, **kwargs: Any) -> nn.Module:
    model = tiny_llama()
    if shard:
        for layer in model.model.layers:
            blockshard.fully_shard(layer, **kwargs)
        blockshard.fully_shard(model, **kwargs)
    return model


def _mlp(shard: bool, **kwargs: Any) -> nn.Module:
    """Two 6144-element matrices, one group each: at W = 2 each is cut into two stripes of 3072
    elements (below bitsandbytes' min_8bit_size of 4096, where one process keeps 8-bit state for the
    whole tensor)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Tanh(), nn.Linear(96, 64, bias=False))
    if shard:  # one group per layer: its matrix is cut between the ranks
        blockshard.fully_shard(model[0], **kwargs)
        blockshard.fully_shard(model[2], **kwargs)
        blockshard.fully_shard(model, **kwargs)
    return model


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    if isinstance(model, nn.Sequential):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
        return (model(x) - x.flip(1)).pow(2).mean()
    ids, labels = text_batches(STEPS, 2, 16)[step]
    return model(input_ids=ids, labels=labels).loss


def _train(model: nn.Module, opts: list[torch.optim.Optimizer], steps: int = STEPS) -> dict[str, Any]:
    for step in range(steps):
        _loss(model, step).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    if blockshard.is_sharded(model):
        return {k: v.clone() for k, v in blockshard.full_state_dict(model).items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _kinds(model: nn.Module, opts: list[torch.optim.Optimizer]) -> dict[str, bool | None]:
    """blockshard.report's "state kind as on one process" per (parameter, state key) of 8-bit state."""
    rep = blockshard.report(model, optimizers=opts)
    return {f"{s.param}/{s.key}": s.as_one_process for o in rep.optimizers for s in o.states if s.key == "state1"}


# -- the optimizers of each scenario: (model) -> optimizers ----------------------------------------
def _by_ndim(model: nn.Module) -> list[torch.optim.Optimizer]:
    """nanoGPT's weight decay: matrices decay, vectors do not (by the tensor it is given)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return [torch.optim.AdamW(groups, lr=1e-2)]


def _by_global_shape(model: nn.Module) -> list[torch.optim.Optimizer]:
    """The recipe: the same choice by the global shape."""
    groups = blockshard.param_groups_by(
        model,
        lambda name, shape: "decay" if len(shape) >= 2 else "no_decay",
        {"decay": {"weight_decay": 0.1}, "no_decay": {"weight_decay": 0.0}},
    )
    return [torch.optim.AdamW(groups, lr=1e-2)]


def _two_by_ndim(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Two optimizers chosen by ndim (matrices with one, vectors with the other)."""
    mats = [p for p in model.parameters() if p.ndim >= 2]
    vecs = [p for p in model.parameters() if p.ndim < 2]
    return [torch.optim.AdamW(mats, lr=1e-2, weight_decay=0.1), torch.optim.AdamW(vecs, lr=1e-2, weight_decay=0.0)]


def _two_by_global_ndim(model: nn.Module) -> list[torch.optim.Optimizer]:
    mats = [p for p in model.parameters() if len(blockshard.global_shape(p)) >= 2]
    vecs = [p for p in model.parameters() if len(blockshard.global_shape(p)) < 2]
    return [torch.optim.AdamW(mats, lr=1e-2, weight_decay=0.1), torch.optim.AdamW(vecs, lr=1e-2, weight_decay=0.0)]


def _overlapping(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Two optimizers that both hold every parameter."""
    return [torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.SGD(model.parameters(), lr=1e-2)]


def _bnb(min_8bit_size: int) -> Callable[[nn.Module], list[torch.optim.Optimizer]]:
    def build(model: nn.Module) -> list[torch.optim.Optimizer]:
        import bitsandbytes as bnb

        return [bnb.optim.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=min_8bit_size)]

    return build


def _torch_muon(model: nn.Module) -> list[torch.optim.Optimizer]:
    """torch's Muon over the matrices of a model sharded element-wise (row stripes)."""
    return [torch.optim.Muon(model.parameters(), lr=1e-2)]


_MODELS: dict[str, Callable[..., nn.Module]] = {"llama": _llama, "mlp": _mlp}
DIFFERS = "differs"  # the control with the checks off (BLOCKSHARD_OPTIMIZER_CHECKS=0): must differ from one process

# name -> (optimizers, fully_shard kwargs, the error the sharded run must raise, None: must equal one
# process, or DIFFERS)
SCENARIOS: dict[str, tuple[Callable[[nn.Module], list[torch.optim.Optimizer]], dict[str, Any], str | None]] = {
    "weight decay by p.ndim": (_by_ndim, {}, "param_groups follow the ndim of this rank's pieces"),
    "weight decay by p.ndim, checks off (control)": (_by_ndim, {}, DIFFERS),
    "weight decay by global shape (control)": (_by_global_shape, {}, None),
    "two optimizers by p.ndim": (_two_by_ndim, {}, "param_groups follow the ndim of this rank's pieces"),
    "two optimizers by global ndim (control)": (_two_by_global_ndim, {}, None),
    "two optimizers over every parameter": (_overlapping, {}, "both step parameter"),
    # element-wise semantics cut the matrices into 3072-element stripes; bnb8bit's keep >= 4096 per piece
    "bnb state below min_8bit_size on a piece": (_bnb(4096), {"model": "mlp"}, "would keep fp32 state"),
    "bnb state below min_8bit_size, checks off (control)": (_bnb(4096), {"model": "mlp"}, DIFFERS),
    "bnb with bnb8bit semantics (control)": (_bnb(4096), {"semantics": "bnb8bit", "model": "mlp"}, None),
    "torch Muon on row stripes": (_torch_muon, {"model": "mlp"}, "Newton-Schulz on a part"),
}


def reference(name: str) -> dict[str, torch.Tensor]:
    """One process: the scenario's optimizers over the unsharded model."""
    build, kwargs, _ = SCENARIOS[name]
    model = _MODELS[kwargs.get("model", "llama")](False)
    return _train(model, build(model))


def run(name: str) -> dict[str, Any]:
    """One scenario on this rank: the error text (and seconds until it), or the trained state."""
    build, kwargs, expected = SCENARIOS[name]
    kwargs = dict(kwargs)
    model = _MODELS[kwargs.pop("model", "llama")](True, **kwargs)
    start = time.monotonic()
    try:
        with unchecked(expected == DIFFERS):
            opts = build(model)
            state = _train(model, opts)
    except Exception as e:  # OptimizerSetupError (a ShardingError) where a check trips; anything else fails the test
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
    return {"state": state, "kinds": _kinds(model, opts) if "bnb" in name else {}}


def all_scenarios(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Every scenario in turn on this rank (spawned ranks: one process group for all of them)."""
    torch.manual_seed(0)
    return {name: run(name) for name in SCENARIOS}


def references(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    return {name: reference(name) for name, (_, _, err) in SCENARIOS.items() if err in (None, DIFFERS)}
