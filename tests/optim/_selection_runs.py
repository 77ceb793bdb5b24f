"""Optimizer selection on a sharded tiny Llama (for test_selection.py): Muon + AdamW chosen by
``muon_param_groups`` after per-layer sharding against one process, the old ``p.ndim == 2`` split
on local pieces as the control, and an optimizer built over the pre-sharding parameters.

Every rank sees the whole batch (docs/design.md, "Sharding invariance"), so a correct split is
bitwise equal to one process at W = 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # spawned ranks import this module
from _experts import EXPERTS as EXPERTS  # the tests read it here
from _experts import per_expert_muon

STEPS = 3
MUON_LR, ADAMW_LR = 0.02, 1e-3


def _model():
    from blockshard._tiny import tiny_llama

    return tiny_llama(0)


def _shard(model) -> list[dict]:
    """Shard per layer with Muon's semantics; returns the param_groups taken before sharding."""
    import blockshard
    from blockshard.optim import muon_param_groups, optimizer_semantics

    before = muon_param_groups(model)
    semantics = optimizer_semantics(before)
    for layer in model.model.layers:
        blockshard.fully_shard(layer, semantics=semantics)
    blockshard.fully_shard(model, semantics=semantics)
    return before


def _optimizers(model, split: str) -> list[torch.optim.Optimizer]:
    from blockshard.optim import muon_param_groups

    if split == "helper":
        muon_group, rest = muon_param_groups(model)
        return [torch.optim.Muon([muon_group], lr=MUON_LR), torch.optim.AdamW([rest], lr=ADAMW_LR)]
    assert split == "ndim"  # the README's recipe before issue 9: local shapes decide
    params = [p for p in model.parameters() if p.numel() > 0]
    return [
        torch.optim.Muon([p for p in params if p.ndim == 2], lr=MUON_LR),
        torch.optim.AdamW([p for p in params if p.ndim != 2], lr=ADAMW_LR),
    ]


def _train(model, opts: list[torch.optim.Optimizer]) -> list[float]:
    from blockshard._tiny import text_batches

    losses = []
    for ids, labels in text_batches(STEPS, 4, 32, seed=0):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    return losses


def reference(_rank: int, _world: int) -> dict:
    """One process, Muon on the hidden matrices (the same names the helper chooses)."""
    model = _model()
    _train(model, _optimizers(model, "helper"))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def sharded(rank: int, world: int, splits: tuple[str, ...]) -> dict:
    """Each split trains a freshly sharded model; also records which rank holds the embedding
    whole and the names the helper chooses before and after sharding, and (``"pre_sharding"``)
    what an optimizer built before sharding does at its first step."""
    import blockshard
    from blockshard.optim import muon_param_groups

    out: dict = {}
    for split in splits:
        model = _model()
        before = _shard(model)
        after = muon_param_groups(model)
        embed = dict(model.named_parameters())["model.embed_tokens.weight"]
        out[split] = {
            "params": None,
            "embed_shape": tuple(embed.shape),
            "before": [g["param_names"] for g in before],
            "after": [g["param_names"] for g in after],
            "empty": [n for n, p in model.named_parameters() if p.numel() == 0],
        }
        _train(model, _optimizers(model, split))
        out[split]["params"] = blockshard.full_state_dict(model)
    out["pre_sharding"] = pre_sharding_optimizer(rank, world)
    return out


def pre_sharding_optimizer(rank: int, world: int) -> str:
    """An optimizer over the parameters taken before fully_shard: its first step must raise."""
    from blockshard._tiny import text_batches
    from blockshard.runtime import ShardingError

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)  # before sharding: replaced objects
    _shard(model)
    ids, labels = text_batches(1, 2, 16, seed=0)[0]
    model(input_ids=ids, labels=labels).loss.backward()
    try:
        opt.step()
    except ShardingError as exc:
        return str(exc)
    return "no error"


def fsdp2_recipe(rank: int, world: int) -> dict:
    """The FSDP2 adapter's docstring recipe on the tiny Llama: names before and after, one step."""
    from blockshard.integrations import fsdp2
    from blockshard.optim import muon_param_groups

    model = _model()
    before = [g["param_names"] for g in muon_param_groups(model)]
    for layer in model.model.layers:
        fsdp2.fully_shard(layer, semantics="muon", root=model)
    fsdp2.fully_shard(model, semantics="muon")
    muon_group, rest = muon_param_groups(model)
    muon = fsdp2.OwnerComputeOptimizer(lambda g: torch.optim.Muon(g, lr=MUON_LR), [muon_group], semantics="matrix")
    adamw = fsdp2.OwnerComputeOptimizer(lambda g: torch.optim.AdamW(g, lr=ADAMW_LR), [rest])
    names = [muon_group["param_names"], rest["param_names"]]
    _train(model, [muon, adamw])  # type: ignore[list-item]  # OwnerComputeOptimizer steps like one
    params = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}  # type: ignore[attr-defined]
    return {"before": before, "after": names, "params": params}


# -- stacked experts (issue 22, item 3): a tiny Mixtral, Muon per expert ------------------------------


def _mixtral_train(model, opts, before_step=None) -> dict:
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        if before_step is not None:
            before_step()
        for o in opts:
            o.step()
            o.zero_grad()
    return {}


def experts_reference(_rank: int, _world: int, per_expert: bool = True) -> dict:
    """One process: torch's Muon on every expert's (m, n) matrix (tests/runtime/_experts.py);
    ``per_expert=False``, the control: on the stack flattened to ``(E * m, n)``."""
    from blockshard._tiny import tiny_mixtral

    model = tiny_mixtral(0)
    opts, grads_to_views = per_expert_muon(model, MUON_LR, ADAMW_LR, per_expert)
    _mixtral_train(model, opts, grads_to_views)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def fsdp2_experts(rank: int, world: int) -> dict:
    """Stock FSDP2 through the adapter (``semantics="muon"``: per-expert grids), ``muon_param_groups``
    after sharding, torch's Muon inside ``fsdp2.OwnerComputeOptimizer``: each expert's matrix."""
    from blockshard._tiny import tiny_mixtral
    from blockshard.integrations import fsdp2
    from blockshard.optim import muon_param_groups

    model = tiny_mixtral(0)
    before = muon_param_groups(model)[0]["param_names"]
    for layer in model.model.layers:
        fsdp2.fully_shard(layer, semantics="muon", root=model)
    fsdp2.fully_shard(model, semantics="muon")
    muon_group, rest = muon_param_groups(model)
    muon = fsdp2.OwnerComputeOptimizer(lambda g: torch.optim.Muon(g, lr=MUON_LR), [muon_group], semantics="matrix")
    adamw = fsdp2.OwnerComputeOptimizer(lambda g: torch.optim.AdamW(g, lr=ADAMW_LR), [rest])
    shapes = sorted({tuple(p.shape) for g in muon.inner.param_groups for p in g["params"]})
    _mixtral_train(model, [muon, adamw])
    params = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}  # type: ignore[attr-defined]
    return {"before": before, "after": muon_group["param_names"], "params": params, "inner_shapes": shapes}
