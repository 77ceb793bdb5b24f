"""Gradient memory ([Note: buffers] in blockshard/runtime/core/_buffers.py): the local gradient buffer
lives exactly as long as a sharded ``.grad`` views it, as FSDP2's sharded gradients do.

In-process gloo at W = 1 (the buffer logic does not depend on W); the spawned tier checks the
same at W = 2 and 4 (test_engine.py, ``grad_freed_by_zero_grad``) and the numbers stay bitwise
against one process there (test_engine.py, test_training_loops.py).
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import blockshard
from blockshard.runtime import local_buffers

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("gloo_w1")]


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        blockshard.fully_shard(layer)
    blockshard.fully_shard(model)
    return model


def _backward(model: nn.Module) -> None:
    model(torch.ones(3, 8)).square().mean().backward()


def _grad_buffers(model: nn.Module) -> int:
    gc.collect()
    return sum("grad" in b for b in local_buffers(model).values())


@pytest.mark.heavy  # in process, seconds: out of `make test-fast` (its one-minute budget)
def test_zero_grad_frees_the_gradient_buffers_and_the_next_step_allocates_new_ones():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert _grad_buffers(model) == 0  # before the first backward: none
    _backward(model)
    assert _grad_buffers(model) == 2
    opt.step()
    opt.zero_grad()  # set_to_none=True, torch's default
    assert _grad_buffers(model) == 0
    _backward(model)
    assert _grad_buffers(model) == 2 and all(p.grad is not None for p in model.parameters())


def test_kept_gradients_accumulate_across_backwards_as_on_one_process():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model = _model()
    for m in (plain, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        _backward(m)
        opt.zero_grad(set_to_none=False)  # zeros, kept: the buffers stay
        _backward(m)
        _backward(m)  # accumulates into the kept .grad
    assert _grad_buffers(model) == 2
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad.reshape(p.grad.shape)), name


def test_a_gradient_the_user_kept_is_not_overwritten_by_the_next_step():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    _backward(model)
    kept = [p.grad for p in model.parameters()]
    copies = [g.clone() for g in kept]
    opt.zero_grad()
    model(2 * torch.ones(3, 8)).square().mean().backward()  # other gradients this time
    assert all(torch.equal(k, c) for k, c in zip(kept, copies, strict=True))
    assert any(not torch.equal(p.grad, c) for p, c in zip(model.parameters(), copies, strict=True))
