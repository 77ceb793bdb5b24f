"""Meta-device init in-process ([Note: meta init] in blockshard/runtime/core/_init.py): W = 1 on a
real gloo group and W = 2 on threads; the spawned tier (test_meta_init.py) checks W = 2, 3, 4
and training from the initial values."""

from __future__ import annotations

import _inproc
import _meta_runs
import pytest
import torch
from torch import nn

import blockshard
from blockshard.runtime import ShardingError

pytestmark = [pytest.mark.timeout(60)]


def _meta_values(rank: int, world: int) -> dict:
    with torch.device("meta"):
        model = _meta_runs.Net()
    for block in model.blocks:
        blockshard.fully_shard(block)
    blockshard.fully_shard(model)
    model.to_empty(device="cpu")
    local_bytes = sum(p.numel() for p in model.parameters())
    with _inproc.serial():  # the process-wide generator: one rank at a time, same seed each
        torch.manual_seed(_meta_runs.SEED)
        blockshard.init_parameters(model)
    return {"values": blockshard.full_state_dict(model), "local_numel": local_bytes}


@pytest.mark.parametrize("world", [1, 2])
def test_meta_init_equals_unsharded_init_bitwise(world):
    want = _meta_runs.reference().state_dict()
    total = sum(v.numel() for k, v in want.items() if "weight" in k or "bias" in k)
    for got in _inproc.run_ranks(_meta_values, world):
        assert all(torch.equal(got["values"][k], v) for k, v in want.items())
        assert got["local_numel"] <= total // world + 64  # each rank materialized its shard only


def test_the_parameters_stay_meta_until_to_empty_and_init_needs_it(gloo_w1):
    with torch.device("meta"):
        model = _meta_runs.Net()
    blockshard.fully_shard(model)
    assert all(p.device.type == "meta" for p in model.parameters())
    with pytest.raises(ShardingError, match=r"on the meta device: call model.to_empty\(device=...\) first"):
        blockshard.init_parameters(model)
    old = list(model.parameters())
    model.to_empty(device="cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())
    opt = torch.optim.SGD(old, lr=0.1)  # built over the meta parameters: they were replaced
    with pytest.raises(ShardingError, match="fully_shard replaced"):
        opt.step()


def test_an_init_that_replaces_a_parameter_raises_and_leaves_the_model_sharded(gloo_w1):
    with torch.device("meta"):
        model = _meta_runs.Net()
    blockshard.fully_shard(model)
    model.to_empty(device="cpu")

    def replace(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(torch.zeros_like(m.weight))

    with pytest.raises(ShardingError, match=r"init replaced parameter 'blocks\.0\.0\.weight'"):
        blockshard.init_parameters(model, init=replace)
    with pytest.raises(ShardingError, match="order='random' must be"):
        blockshard.init_parameters(model, order="random")


def test_a_forward_before_to_empty_raises_naming_the_parameters_and_the_fix(gloo_w1):
    # FSDP2 raises "should be materialized from meta device before training"; blockshard used to
    # fail inside torch ("Tensor on device meta is not on the expected device cpu!")
    with torch.device("meta"):
        model = _meta_runs.Net()
    for block in model.blocks:
        blockshard.fully_shard(block)
    blockshard.fully_shard(model)
    x = torch.randint(0, 37, (2, 5))
    with pytest.raises(
        ShardingError, match=r"group 'Net' runs forward with its parameters still on the meta device \(\['embed"
    ):
        model(x)
    model.to_empty(device="cpu")  # the control: once materialized, the same forward runs
    blockshard.init_parameters(model)
    assert model(x).shape[0] == 2
    with torch.device("meta"):
        other = nn.Linear(3, 3)
    blockshard.fully_shard(other)
    with pytest.raises(
        ShardingError, match=r"Fix: materialize the model before training: model.to_empty\(device=...\)"
    ):
        other(torch.randn(1, 3))
