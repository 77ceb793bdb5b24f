"""Per-group settings are checked equal across ranks at ``fully_shard`` (issue 29, item 3): a rank
with ``mp_policy`` bf16 alone gathered bf16 against its peers' fp32 and gloo aborted the process
("Received data size doesn't match expected size"); ``reshard_after_forward`` differing ended
after the collective timeout without naming it. Now every rank raises ``LayoutMismatchError``
naming the setting and each rank's value, at once. Control: equal settings shard and train."""

from __future__ import annotations

import re

import _inproc
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import blockshard
from blockshard.runtime import LayoutMismatchError

pytestmark = pytest.mark.timeout(60)


def _shard(rank: int, world: int, per_rank: dict) -> str:
    with _inproc.serial():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    kwargs = per_rank.get(rank, {})
    try:
        blockshard.fully_shard(model[0], **kwargs)
        blockshard.fully_shard(model, **kwargs)
    except LayoutMismatchError as e:
        return str(e)
    model(torch.randn(2, 6)).sum().backward()
    return "trained"


@pytest.mark.parametrize(
    ("per_rank", "text"),
    [
        (
            {1: {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}},
            r"mp_policy: rank 0: None, rank 1: MixedPrecisionPolicy\(param_dtype=torch.bfloat16",
        ),
        pytest.param(  # heavy: in process, seconds: out of `make test-fast` (its one-minute budget)
            {0: {"reshard_after_forward": False}},
            r"reshard_after_forward: rank 0: False, rank 1: None",
            marks=pytest.mark.heavy,
        ),
        pytest.param({1: {"policy": "whole"}}, r"policy: rank 0: 'auto', rank 1: 'whole'", marks=pytest.mark.heavy),
    ],
    ids=["mp_policy", "reshard_after_forward", "policy"],
)
def test_settings_that_differ_between_ranks_raise_on_every_rank(per_rank, text):
    got = _inproc.run_ranks(_shard, 2, args=(per_rank,))
    assert all(g.startswith("fully_shard of Linear: the ranks passed different settings (") for g in got), got
    assert all(re.search(text, g) for g in got), got


def test_control_equal_settings_shard_and_train():
    same = {
        r: {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16), "reshard_after_forward": False}
        for r in (0, 1)
    }
    assert _inproc.run_ranks(_shard, 2, args=(same,)) == ["trained", "trained"]
