"""[Note: parameters added after fully_shard]: a trainable parameter registered under a sharded
module afterwards (its gradient would never be averaged: each rank would train its own copy) is
refused at the root's next forward on every rank, naming it; frozen ones, ``ignored_params`` and
W = 1 pass. Two gloo thread ranks."""

from __future__ import annotations

import _inproc
import pytest
import torch
from torch import nn

import blockshard
from blockshard.runtime import ShardingError


def _net() -> nn.Module:
    with _inproc.serial():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _attach(rank: int, world: int, how: str) -> str:
    model = _net()
    extra = nn.Linear(8, 8) if how != "ignored" else None
    if how == "ignored":
        model.append(nn.Linear(8, 8))
        blockshard.fully_shard(model, ignored_params=set(model[3].parameters()))
    else:
        blockshard.fully_shard(model)
        model(torch.ones(2, 8)).sum().backward()  # a step before: the root has initialized
        assert extra is not None
        if how == "frozen":
            extra.requires_grad_(False)
        model.append(extra)  # e.g. a head attached after sharding
    try:
        model(torch.ones(2, 8)).sum().backward()
    except ShardingError as e:
        return str(e)
    return "ran"


def test_a_trainable_module_attached_after_fully_shard_raises_on_every_rank():
    for msg in _inproc.run_ranks(_attach, 2, args=("trainable",)):
        assert "added under a sharded module after fully_shard: 3.weight (8, 8), 3.bias (8,)" in msg, msg
        assert "over the 2 ranks" in msg and "Fix: add them before fully_shard" in msg


@pytest.mark.parametrize("how", ["frozen", "ignored"])
def test_frozen_or_ignored_parameters_pass(how):
    assert _inproc.run_ranks(_attach, 2, args=(how,)) == ["ran", "ran"]


def test_at_one_rank_nothing_needs_averaging(gloo_w1):
    with _inproc.single_thread():
        assert _attach(0, 1, "trainable") == "ran"
