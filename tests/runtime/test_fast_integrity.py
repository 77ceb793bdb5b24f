"""The pieces of [Note: collective integrity] that need no misbehaving peer."""

from __future__ import annotations

import _inproc
import pytest
import torch
from torch import nn

import blockshard
from blockshard import BlockshardError
from blockshard.runtime.core._collectives import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, collective_timeout_s
from blockshard.runtime.core._collectives import step_mismatch as _mismatch
from blockshard.runtime.core._common import CollectiveTally


def test_the_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert collective_timeout_s() == DEFAULT_TIMEOUT_S
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert collective_timeout_s() == 2.5
    monkeypatch.setenv(TIMEOUT_ENV, "1")  # the lower bound itself
    assert collective_timeout_s() == 1.0


@pytest.mark.parametrize("bad", ["abc", "0", "-3", "nan", "inf", "1e12", "1e-3", "0.999"])
def test_a_bad_timeout_names_the_variable(monkeypatch, bad):
    # 1e-3 was accepted and the engine group's setup then failed with gloo's "Connect timeout"
    monkeypatch.setenv(TIMEOUT_ENV, bad)
    with pytest.raises(BlockshardError, match=rf"{TIMEOUT_ENV}='{bad}' must be a number of seconds >= 1 and <= 86400"):
        collective_timeout_s()


def _shard_and_step(rank: int, world: int) -> float:
    with _inproc.serial():
        torch.manual_seed(0)
        model = nn.Linear(8, 8)
    blockshard.fully_shard(model)  # creates the engine's group with the timeout (on gloo)
    model(torch.ones(2, 8)).sum().backward()
    return float(model.weight.grad.abs().sum())


@pytest.mark.timeout(60)
def test_the_timeout_bound_is_enough_for_the_engine_group(monkeypatch):
    """At the lower bound (1 s) the engine's group is set up and a step's collectives run on 2
    gloo threads; below it (1e-3 s, which gloo's setup did not survive) every rank raises first."""
    monkeypatch.setenv(TIMEOUT_ENV, "1")
    assert all(g > 0 for g in _inproc.run_ranks(_shard_and_step, 2, timeout=30))
    monkeypatch.setenv(TIMEOUT_ENV, "1e-3")
    with pytest.raises(BlockshardError, match=rf"{TIMEOUT_ENV}='1e-3' must be a number of seconds >= 1"):
        _inproc.run_ranks(_shard_and_step, 2, timeout=30)


def test_the_tally_is_order_sensitive():
    a, b = CollectiveTally(), CollectiveTally()
    for i, k in [(0, 0), (1, 0), (1, 1)]:
        a.record(i, k)
    for i, k in [(1, 0), (0, 0), (1, 1)]:
        b.record(i, k)
    assert a.count == b.count and a.hash != b.hash


def test_the_mismatch_message_names_what_differs_and_the_fix():
    msg = _mismatch("Tower", [[3, 7, 11, 5, 2], [2, 6, 11, 5, 2]])
    assert "step (rank 0: 3, rank 1: 2)" in msg and "collectives issued (rank 0: 7, rank 1: 6)" in msg
    differs = msg.split("did not line up")[1].split(". A rank")[0]
    assert "requires_grad" not in differs and "optimizer steps" not in differs
    assert "Fix: run the same forward, backward and optimizer step on every rank" in msg


def test_the_mismatch_message_names_differing_optimizer_steps():
    msg = _mismatch("Tower", [[3, 7, 11, 5, 2], [3, 7, 11, 5, 1]])
    differs = msg.split("did not line up")[1].split(". A rank")[0]
    assert differs == " in this step: optimizer steps (rank 0: 2, rank 1: 1)", differs


def test_a_rank_that_never_steps_an_optimizer_is_not_a_mismatch():
    """Ranks that hold no element to step (empty pieces filtered out) build no optimizer."""
    msg = _mismatch("Tower", [[3, 7, 11, 5, 2], [3, 7, 11, 5, 0], [3, 6, 11, 5, 2]])
    differs = msg.split("did not line up")[1].split(". A rank")[0]
    assert "optimizer steps" not in differs and "collectives issued" in differs, differs
