"""Bad input to ``fully_shard`` (issue 9, point 6), on a real gloo group of one rank in this process."""

from __future__ import annotations

import pytest
from torch import nn

import blockshard
from blockshard import SemanticsError
from blockshard.runtime import ShardingError


@pytest.mark.parametrize("alignment", [3, 12])
def test_fully_shard_refuses_alignment_not_a_power_of_two(gloo_w1, alignment):
    with pytest.raises(ShardingError) as info:
        blockshard.fully_shard(nn.Linear(4, 4), alignment_bytes=alignment)
    msg = str(info.value)
    assert f"alignment_bytes={alignment} must be a positive integer power of two" in msg
    assert "pass e.g. alignment_bytes=16" in msg


def test_fully_shard_wraps_a_semantics_callable_that_raises(gloo_w1):
    def pick(name, param):
        return {"bias": "elementwise"}[name]  # forgets "weight"

    with pytest.raises(SemanticsError) as info:
        blockshard.fully_shard(nn.Linear(4, 3), semantics=pick)
    msg = str(info.value)
    assert "semantics callable test_fully_shard_wraps_a_semantics_callable_that_raises.<locals>.pick" in msg
    assert "raised on parameter 'weight' (shape (3, 4)): KeyError: 'weight'; fix the callable" in msg
    blockshard.fully_shard(nn.Linear(4, 3), semantics=lambda name, param: "elementwise")  # control
