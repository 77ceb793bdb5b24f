"""Gradient clipping runs for test_clip.py (spawned ranks) and test_fast_clip.py (threads).

Every function takes ``(rank, world, ...)`` and returns plain values. Every rank trains on the
whole batch, so averaged gradients equal one process's exactly and any difference comes from
how the norm is computed. ``how``: "blockshard" (``blockshard.clip_grad_norm_(model)``),
"params" (the same on ``model.parameters()``), "torch_routed" (``torch.nn.utils.clip_grad_norm_``,
which the first ``fully_shard`` routes to blockshard's on sharded pieces: [Note: clipping]) or
"torch" (torch's own function, unrouted, on the local pieces: the control).
"""

from __future__ import annotations

import _inproc
import torch
from _scenarios import _batches, _blocks, _loss_fn, _model

import blockshard

STEPS = 3
INF = float("inf")
NORM_RTOL = 1e-6  # tolerances: see test_fast_clip.py
PARAM_ATOL = 1e-6
LR = 1e-2
MAX_NORM = {2.0: 0.05, 1.0: 0.5, float("inf"): 0.01}  # all well below the norms seen: every step clips
BATCH = 6


def _optimizer(name: str, params):
    if name == "sgd":  # the update is linear in the gradient: clipping shows in full
        return torch.optim.SGD(params, lr=LR * 10)
    return torch.optim.AdamW(params, lr=LR)


def _clip(model, how: str, max_norm: float, norm_type: float) -> torch.Tensor:
    if how == "blockshard":
        return blockshard.clip_grad_norm_(model, max_norm, norm_type)
    if how == "params":
        return blockshard.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    if how == "torch_routed":
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    return torch_own_clip()(model.parameters(), max_norm, norm_type)


def torch_own_clip():
    """torch's ``clip_grad_norm_`` itself, whether or not blockshard routed it: its ``no_grad``
    wrapper's ``__wrapped__`` is torch's implementation, whatever the wrapper's cell holds."""
    return torch.no_grad()(torch.nn.utils.clip_grad_norm_.__wrapped__)


def train(
    rank: int,
    world: int,
    kind: str,
    norm_type: float,
    *,
    sharded: bool,
    how: str = "blockshard",
    semantics: str | None = None,
    optimizer: str = "adamw",
    steps: int = STEPS,
) -> dict:
    """``steps`` steps with clipping; one process uses torch's ``clip_grad_norm_`` on the whole model."""
    with _inproc.serial():  # model constructors seed torch's process-wide generator
        model = _model(kind)
    if sharded:
        for block in _blocks(model, kind):
            blockshard.fully_shard(block, semantics=semantics)
        blockshard.fully_shard(model, semantics=semantics)
    opt = _optimizer(optimizer, model.parameters())
    loss_fn, data = _loss_fn(kind), _batches(kind, BATCH)
    max_norm, norms = MAX_NORM[norm_type], []
    for step in range(steps):
        loss_fn(model, data[step % len(data)]).backward()
        if sharded:
            norms.append(_clip(model, how, max_norm, norm_type).clone())
        else:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type).clone())
        opt.step()
        opt.zero_grad()
    params = (
        blockshard.full_state_dict(model) if sharded else {n: p.detach().clone() for n, p in model.named_parameters()}
    )
    return {"norms": norms, "params": params, "shapes": [tuple(p.shape) for p in model.parameters()]}


def cases(rank: int, world: int, cases: tuple) -> dict:
    """Several :func:`train` runs in one set of ranks: ``cases`` of ``(key, args, kwargs)``."""
    return {key: train(rank, world, *args, sharded=True, **kwargs) for key, args, kwargs in cases}


def references(_rank: int, _world: int, cases: tuple) -> dict:
    return {key: train(0, 1, *args, sharded=False, **kwargs) for key, args, kwargs in cases}


def with_replicated(rank: int, world: int, sharded: bool) -> dict:
    """A sharded MLP plus one parameter outside every group (the same on every rank): counted once."""
    with _inproc.serial():
        model = _model("mlp")
        extra = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 11))
    if sharded:
        for block in _blocks(model, "mlp"):
            blockshard.fully_shard(block)
        blockshard.fully_shard(model)
    x, y = _batches("mlp", BATCH)[0]
    ((model(x) - y) ** 2).mean().add((extra**2).sum()).backward()
    params = [*model.parameters(), extra]
    clip = blockshard.clip_grad_norm_ if sharded else torch.nn.utils.clip_grad_norm_
    norm = clip(params, 0.05, 2.0)
    return {"norm": norm, "extra_grad": extra.grad.clone()}


def nonfinite(rank: int, world: int) -> str:
    """One rank's piece holds an inf: every rank's total is inf and ``error_if_nonfinite`` raises."""
    with _inproc.serial():
        model = _model("mlp")
    for block in _blocks(model, "mlp"):
        blockshard.fully_shard(block)
    blockshard.fully_shard(model)
    x, y = _batches("mlp", BATCH)[0]
    ((model(x) - y) ** 2).mean().backward()
    if rank == world - 1:
        next(g for p in model.parameters() if (g := p.grad) is not None and g.numel()).view(-1)[0] = float("inf")
    try:
        blockshard.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
    except RuntimeError as e:
        return str(e)
    return "no error"


def check_matches(got: list[dict], want: dict, norm_type: float) -> None:
    """Every rank: the same norm as one process (and as each other), the same parameters."""
    exact = norm_type == INF  # a max is exact; p-th power sums are reordered
    for rank, res in enumerate(got):
        for step, (n, ref) in enumerate(zip(res["norms"], want["norms"], strict=True)):
            assert torch.equal(n, got[0]["norms"][step]), f"rank {rank} step {step}: not the same norm as rank 0"
            if exact:
                assert torch.equal(n, ref), f"rank {rank} step {step}: {n.item()} != {ref.item()}"
            else:
                torch.testing.assert_close(n, ref, rtol=NORM_RTOL, atol=0)
        for name, ref in want["params"].items():
            if exact:
                assert torch.equal(res["params"][name], ref), f"rank {rank}: {name} not bitwise"
            else:
                torch.testing.assert_close(res["params"][name], ref, rtol=0, atol=PARAM_ATOL)
