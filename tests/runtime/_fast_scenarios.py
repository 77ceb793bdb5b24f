"""Small training runs for the fast, in-process engine tests (W = 1 in the test thread, W = 2 on
``_inproc.run_ranks`` threads). Every function takes ``(rank, world, ...)`` like the spawned
scenarios of ``_scenarios.py`` and returns plain values; the tests assert in the test thread.

Sizes are chosen for speed: 2 AdamW steps, batches of 6 (MLP) or 3 x 16 tokens (tiny Llama).
"""

from __future__ import annotations

import _inproc
import torch
from _scenarios import _batches, _blocks, _loss_fn, _model
from torch import nn

import blockshard

LR = 1e-2
STEPS = 2
BATCH = {"mlp": 6, "llama": 3}


def shard(model: nn.Module, kind: str, *, reshard_after_forward: bool = True, semantics=None) -> nn.Module:
    """``fully_shard`` per layer (block), then the root."""
    for block in _blocks(model, kind):
        blockshard.fully_shard(block, reshard_after_forward=reshard_after_forward, semantics=semantics)
    blockshard.fully_shard(model, semantics=semantics)
    return model


def batches(kind: str, micro: int = 1) -> list:
    return _batches(kind, BATCH[kind], micro)[: STEPS * micro]


def train(
    rank: int,
    world: int,
    kind: str,
    *,
    sharded: bool,
    lr: float = LR,
    micro: int = 1,
    sync_last_only: bool = True,
    wrap=None,
    shard_kwargs: dict | None = None,
) -> dict:
    """``STEPS`` AdamW steps of ``micro`` accumulated micro-batches (every rank the whole batch).

    Sharded: gradient sync off for the first ``micro - 1`` micro-batches and on for the last
    (``sync_last_only=False`` turns it on for the first only: a control). ``wrap(model)`` runs
    after the layers are sharded and before the root is (e.g. activation checkpointing).
    ``shard_kwargs`` go to every ``fully_shard`` (e.g. ``offload_policy``).
    Returns the losses, the full parameters by name, the parameter shapes this rank holds and the
    devices its parameters, gradients and optimizer state were on before the last ``zero_grad``.
    """
    with _inproc.serial():  # the constructors seed torch's process-wide generator
        model = _model(kind)
    if sharded:
        for block in _blocks(model, kind):
            blockshard.fully_shard(block, **(shard_kwargs or {}))
        if wrap is not None:
            wrap(model)
        blockshard.fully_shard(model, **(shard_kwargs or {}))
    loss_fn = _loss_fn(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    data = batches(kind, micro)
    losses = []
    for step in range(STEPS):
        for m in range(micro):
            if sharded:
                model.set_requires_gradient_sync(m == micro - 1 if sync_last_only else m == 0)
            loss = loss_fn(model, data[step * micro + m])
            loss.backward()
            losses.append(loss.detach().clone())
        opt.step()
        devices = {
            "params": {p.device.type for p in model.parameters()},
            "grads": {p.grad.device.type for p in model.parameters() if p.grad is not None},
            "optimizer": {v.device.type for s in opt.state.values() for v in s.values() if torch.is_tensor(v)},
        }
        opt.zero_grad()
    full = (
        blockshard.full_state_dict(model) if sharded else {n: p.detach().clone() for n, p in model.named_parameters()}
    )
    shapes = [tuple(p.shape) for p in model.parameters()]
    return {"losses": losses, "params": full, "shapes": shapes, "devices": devices}


def bitwise_diffs(got: dict, want: dict) -> dict[str, float]:
    """Parameters (and losses) that are not bitwise equal, with their largest difference."""
    out = {}
    for name in sorted(set(got["params"]) | set(want["params"])):
        a, b = got["params"].get(name), want["params"].get(name)
        if a is None or b is None or a.shape != b.shape:
            out[name] = float("inf")
        elif not torch.equal(a, b):
            out[name] = (a - b).abs().max().item()
    for i, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        if not torch.equal(a, b):
            out[f"loss[{i}]"] = (a - b).abs().item()
    return out
