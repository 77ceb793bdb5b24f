"""The pieces of [Note: collective integrity] that need no misbehaving peer."""

from __future__ import annotations

import gc
import weakref

import _inproc
import pytest
import torch
import torch.distributed as dist
from torch import nn

import blockshard
from blockshard import BlockshardError
from blockshard.runtime.core._collectives import (
    _HEADERS,
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    collective_timeout_s,
    engine_group,
)
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
    msg = _mismatch("Tower", [[3, 7, 11, 5, 9, 2], [2, 6, 11, 5, 9, 2]])
    assert "step (rank 0: 3, rank 1: 2)" in msg and "collectives issued (rank 0: 7, rank 1: 6)" in msg
    differs = msg.split("did not line up")[1].split(". A rank")[0]
    assert "requires_grad" not in differs and "optimizer steps" not in differs
    assert "Fix: run the same forward, backward and optimizer step on every rank" in msg


def test_the_mismatch_message_names_differing_optimizer_steps():
    msg = _mismatch("Tower", [[3, 7, 11, 5, 9, 2], [3, 7, 11, 5, 9, 1]])
    differs = msg.split("did not line up")[1].split(". A rank")[0]
    assert differs == " in this step: optimizer steps (rank 0: 2, rank 1: 1)", differs


def test_a_rank_that_never_steps_an_optimizer_is_not_a_mismatch():
    """Ranks that hold no element to step (empty pieces filtered out) build no optimizer: their
    record carries the ``never`` mark, and they are left out."""
    never = 1 << 62
    msg = _mismatch("Tower", [[3, 7, 11, 5, 9, 2], [3, 7, 11, 5, 9, never], [3, 6, 11, 5, 9, 2]], never=never)
    differs = msg.split("did not line up")[1].split(". A rank")[0]
    assert "optimizer steps" not in differs and "collectives issued" in differs, differs


def test_a_rank_that_holds_trainable_elements_and_never_stepped_is_a_mismatch():
    """The control of the one above: zero steps on a rank that holds something to step (optimizer.step()
    on rank 0 only) is named, the rank holding nothing shown as '-'."""
    never = 1 << 62
    msg = _mismatch("Tower", [[3, 7, 11, 5, 9, 2], [3, 7, 11, 5, 9, 0], [3, 7, 11, 5, 9, never]], never=never)
    differs = msg.split("did not line up")[1].split(". A rank")[0]
    assert differs == " in this step: optimizer steps (rank 0: 2, rank 1: 0, rank 2: -)", differs


# -- [Note: collective headers] ----------------------------------------------------------------------
def test_the_header_message_names_each_ranks_collective_and_the_cause():
    from blockshard.runtime.core._collectives import header_mismatch

    said = [
        ("the all-gather of group 'Linear' (c)", "in the backward of step 2", 20, "torch.float32", True),
        (
            "the all-gather of group 'Linear' (a)",
            "in the forward (2nd since the last backward) of step 2",
            204,
            "torch.float32",
            True,
        ),
    ]
    msg = header_mismatch(said, 0)
    assert msg.startswith("blockshard: the ranks' collectives do not line up (seen on rank 0 of 2): rank 0: the ")
    assert "rank 1: the all-gather of group 'Linear' (a) (204 elements of float32) in the forward (2nd" in msg
    assert "Likely cause: rank 1 ran a forward where the others ran the backward" in msg
    assert "gradient sync" not in msg.split("Likely cause:")[1].split(". Nothing")[0]


def test_the_header_message_names_gradient_sync_and_calls_on_some_ranks_only():
    from blockshard.runtime.core._collectives import header_mismatch

    rs = ("the reduce-scatter of group 'Linear' (c)", "in the backward of step 2", 20, "torch.float32", True)
    ag = ("the all-gather of group 'Linear' (a)", "in the backward of step 2", 204, "torch.float32", False)
    assert "gradient sync is off on rank 1 only" in header_mismatch([rs, ag], 1)
    load = ("a call of blockshard.load_checkpoint", "", 0, "None", None)
    msg = header_mismatch([ag, load, load], 2)
    assert "Likely cause: blockshard.load_checkpoint was called on ranks 1, 2 only" in msg, msg
    assert "rank 1: a call of blockshard.load_checkpoint," in msg  # no element count for a call


def test_the_headers_setting_is_validated(monkeypatch):
    from blockshard.runtime.core._collectives import HEADERS_ENV, headers_on

    for raw, on in (("", True), ("1", True), ("0", False)):
        monkeypatch.setenv(HEADERS_ENV, raw)
        assert headers_on() is on
    monkeypatch.setenv(HEADERS_ENV, "off")
    with pytest.raises(BlockshardError, match=rf"{HEADERS_ENV}='off' must be 1 .* or 0"):
        headers_on()


def _headers_then_train(rank: int, world: int) -> list[bool]:
    from blockshard.runtime.core._collectives import uses_headers
    from blockshard.runtime.core._state import state_of

    with _inproc.serial():
        torch.manual_seed(0)
        model = nn.Linear(8, 8)
    blockshard.fully_shard(model)
    model(torch.ones(2, 8)).sum().backward()
    return [uses_headers(state_of(model).buffers.process_group)]


def test_the_headers_setting_reaches_the_engine_group(monkeypatch):
    """BLOCKSHARD_COLLECTIVE_HEADERS is read when fully_shard makes the group (threads share one
    environment, so both ranks agree; ranks that differ are refused by check_same_settings, as
    collective_headers)."""
    monkeypatch.setenv("BLOCKSHARD_COLLECTIVE_HEADERS", "0")
    assert _inproc.run_ranks(_headers_then_train, 2) == [[False], [False]]
    monkeypatch.delenv("BLOCKSHARD_COLLECTIVE_HEADERS")
    assert _inproc.run_ranks(_headers_then_train, 2) == [[True], [True]]


def _engine_and_header_groups(rank: int, world: int) -> list:
    engine = engine_group(dist.group.WORLD)
    refs = [weakref.ref(engine), weakref.ref(_HEADERS[engine].group)]
    _shard_and_step(rank, world)  # a model that ran its collectives on them, dropped on return
    return refs


def test_the_engine_and_header_groups_are_freed_with_the_world():
    """Once the user's group is destroyed and the models are dropped, the engine's gloo groups go
    too (their TCP pairs close, so a failed rank's peers see it at once; the header entries once
    held their own keys and kept both groups for the process)."""
    refs = _inproc.run_ranks(_engine_and_header_groups, 2)
    gc.collect()
    assert [[r() is None for r in rank] for rank in refs] == [[True, True], [True, True]]
