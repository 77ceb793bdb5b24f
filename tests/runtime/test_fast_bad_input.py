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


@pytest.mark.parametrize("alignment", [2**13, 2**30, 2**62])
def test_fully_shard_refuses_alignment_over_a_page(gloo_w1, alignment):
    with pytest.raises(ShardingError) as info:  # 2**30 allocated a GiB, 2**40 died allocating
        blockshard.fully_shard(nn.Linear(4, 4), alignment_bytes=alignment)
    msg = str(info.value)
    assert "alignment_bytes=" in msg and "is more than 4096 bytes (a page)" in msg
    assert "pass e.g. alignment_bytes=16" in msg
    blockshard.fully_shard(nn.Linear(4, 4), alignment_bytes=4096)  # control: the bound itself


def test_fully_shard_wraps_a_semantics_callable_that_raises(gloo_w1):
    def pick(name, param):
        return {"bias": "elementwise"}[name]  # forgets "weight"

    with pytest.raises(SemanticsError) as info:
        blockshard.fully_shard(nn.Linear(4, 3), semantics=pick)
    msg = str(info.value)
    assert "semantics callable test_fully_shard_wraps_a_semantics_callable_that_raises.<locals>.pick" in msg
    assert "raised on parameter 'weight' (shape (3, 4)): KeyError: 'weight'; fix the callable" in msg
    blockshard.fully_shard(nn.Linear(4, 3), semantics=lambda name, param: "elementwise")  # control


def test_fully_shard_refuses_tensor_subclass_parameters_naming_the_fix(gloo_w1):
    # torch's test_fully_shard_extensions.py shards TwoTensor weights and weights with FSDP2's
    # fsdp_pre_all_gather extension; blockshard's flat buffers would keep only the values (a
    # TwoTensor trained as its .a, a bf16 all-gather run in fp32): it refuses them by name
    import torch
    from torch.testing._internal.two_tensor import TwoTensor

    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4))
    model[0].weight = nn.Parameter(TwoTensor(model[0].weight.detach(), model[0].weight.detach().clone()))
    with pytest.raises(ShardingError, match=r"parameter '0.weight' is a TwoTensor, a tensor subclass; .*Fix: convert"):
        blockshard.fully_shard(model)
    blockshard.fully_shard(model, ignored_params={model[0].weight})  # the control: left out, it is accepted
    assert type(model[0].weight) is TwoTensor

    plain = nn.Linear(4, 4)
    plain.weight.fsdp_pre_all_gather = lambda *args: None  # FSDP2's extension on the instance
    with pytest.raises(ShardingError, match=r"'weight' is a Parameter with FSDP2's all-gather extension"):
        blockshard.fully_shard(plain)
    assert blockshard.fully_shard(nn.Linear(4, 4))(torch.ones(1, 4)).shape == (1, 4)  # plain parameters shard
