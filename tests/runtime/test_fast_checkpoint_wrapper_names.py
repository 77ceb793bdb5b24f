"""Optimizer state of a model with torch's ``checkpoint_wrapper`` layers is named as ``state_dict()``
names the parameters (without ``_checkpoint_wrapped_module.``, as DCP's ``get_state_dict`` does), so
a checkpoint saved with activation checkpointing loads into the model without it (the Accelerate
plugin's ``fsdp_activation_checkpointing``). W = 1, in process."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import blockshard

WRAPPED = "_checkpoint_wrapped_module."


def _model(wrap: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Sequential(nn.Linear(10, 10), nn.GELU()), nn.Linear(10, 3))
    if wrap:
        model[1] = checkpoint_wrapper(model[1])
    blockshard.fully_shard(model[1]._checkpoint_wrapped_module if wrap else model[1])
    blockshard.fully_shard(model)
    return model


def _trained(wrap: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(wrap)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6, generator=torch.Generator().manual_seed(1))).sum().backward()
    opt.step()
    return model, opt


def _values(state: dict) -> dict:
    return {(n, k): v.full_tensor() if hasattr(v, "full_tensor") else v for n, e in state.items() for k, v in e.items()}


def test_optimizer_state_names_drop_the_checkpoint_wrapper_and_load_without_it(gloo_w1):
    wrapped, opt = _trained(wrap=True)
    assert any(WRAPPED in n for n, _ in wrapped.named_parameters())  # control: the parameters' names have it
    saved = blockshard.optimizer_state_dict(wrapped, opt)
    assert set(saved["state"]) == set(wrapped.state_dict()) and not any(WRAPPED in n for n in saved["state"])
    plain, plain_opt = _trained(wrap=False)  # the same step without the wrapper: the same state
    for p in plain_opt.state.values():
        p["exp_avg"].zero_()  # made different, so the load below must restore it
    blockshard.load_optimizer_state_dict(plain, plain_opt, saved)
    loaded = _values(blockshard.optimizer_state_dict(plain, plain_opt)["state"])
    expected = _values(saved["state"])
    assert sorted(loaded) == sorted(expected)
    assert all(torch.equal(torch.as_tensor(loaded[k]), torch.as_tensor(expected[k])) for k in expected)
