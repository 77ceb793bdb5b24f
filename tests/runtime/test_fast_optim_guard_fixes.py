"""The optimizer guard's fixes work from where the user is (issue 22, item 6): a message never
sends a user of ``OwnerComputeOptimizer`` / ``blockshard.optim.Muon`` back to the class in use, and
whole compute units inside an owner-computed tensor's piece are not refused
([Note: optimizer guard], blockshard/runtime/core/_optim_guard.py). In-process: W = 1 on the test
thread's gloo group, W = 2 on threads."""

from __future__ import annotations

import _inproc
import pytest
import torch
from torch import nn

import blockshard
from blockshard.optim import BlockedShampoo, Muon, OwnerComputeError, OwnerComputeOptimizer, muon_param_groups
from blockshard.runtime import ShardingError

pytestmark = pytest.mark.timeout(60)  # in-process ranks: a hang fails the test, never the run


def _linear(rows: int, seed: int = 0) -> nn.Linear:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Linear(8, rows, bias=False)


def _shampoo(groups):
    return BlockedShampoo(groups, lr=1e-2, max_preconditioner_dim=4)


def _step(model: nn.Module, opt) -> None:
    for _ in range(2):
        model(torch.linspace(-1, 1, 16).view(2, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()


def _shampoo_under_owner(rank: int, world: int, rows: int, wrap: bool) -> object:
    with _inproc.serial():
        model = _linear(rows)
    blockshard.fully_shard(model, semantics="shampoo:4", policy="owner")
    opt = OwnerComputeOptimizer(_shampoo, model.named_parameters()) if wrap else _shampoo(list(model.parameters()))
    try:
        _step(model, opt)
    except ShardingError as exc:
        return str(exc)
    return blockshard.full_state_dict(model)["weight"]


def test_owner_compute_over_shampoo_steps_whole_stripes_in_place_bitwise_one_process():
    """(16, 8) at W = 2: each rank holds two whole 4-row stripes of an owner-computed tensor. The guard
    used to refuse the wrapper's inner BlockedShampoo there, telling the user to use
    OwnerComputeOptimizer, the class in use."""
    want = _linear(16)
    with _inproc.single_thread():
        _step(want, _shampoo(list(want.parameters())))
    for got in _inproc.run_ranks(_shampoo_under_owner, 2, args=(16, True)):
        assert isinstance(got, torch.Tensor), got
        assert torch.equal(got, want.weight.detach())


def test_plain_shampoo_on_a_cut_stripe_raises_with_the_shampoo_fix():
    """Control: (12, 8) at W = 2 cuts the middle stripe; plain BlockedShampoo on the pieces raises on
    every rank holding a piece, and the fix wraps BlockedShampoo (not torch's Muon)."""
    msgs = _inproc.run_ranks(_shampoo_under_owner, 2, args=(12, False))
    for msg in msgs:
        assert "cut inside a compute unit" in msg, msg
        assert "OwnerComputeOptimizer(lambda groups: BlockedShampoo(groups, ...)" in msg and "Muon" not in msg


@pytest.mark.parametrize("make", ["owner_compute", "muon", "torch_muon"])
def test_an_optimizer_built_before_fully_shard_gets_a_fix_for_what_it_is(gloo_w1, make):
    model = _linear(6)
    if make == "owner_compute":
        opt = OwnerComputeOptimizer(lambda g: torch.optim.Muon(g, lr=0.02), model.named_parameters())
    elif make == "muon":
        opt = Muon(model.named_parameters(), lr=0.02)
    else:
        opt = torch.optim.Muon(model.parameters(), lr=0.02)
    blockshard.fully_shard(model, semantics="matrix")
    with pytest.raises(ShardingError, match="fully_shard replaced") as info:
        _step(model, opt)
    msg = str(info.value)
    what = {"owner_compute": "the OwnerComputeOptimizer", "muon": "the Muon", "torch_muon": "the optimizer"}[make]
    assert f"Fix: build {what} after fully_shard, over muon_param_groups(model) called after sharding" in msg, msg
    assert "accelerator.prepare(model)" in msg
    assert "step it with" not in msg  # never "use the class you use"
    muon_group, _ = muon_param_groups(model)  # control: built after sharding, each steps
    for opt in (OwnerComputeOptimizer(lambda g: torch.optim.Muon(g, lr=0.02), [muon_group]), Muon([muon_group])):
        _step(model, opt)


def test_a_torch_optimizer_with_too_few_param_names_names_the_position(gloo_w1):
    model = _linear(6)
    stale = list(model.parameters())
    blockshard.fully_shard(model)
    opt = torch.optim.AdamW([{"params": stale, "param_names": []}], lr=1e-3)  # torch keeps the empty list
    with pytest.raises(ShardingError, match=r"AdamW holds a parameter of shape \(6, 8\) \(param_groups\[0\]"):
        _step(model, opt)  # used to be an IndexError inside the guard


def test_malformed_state_dicts_raise_naming_what_is_missing(gloo_w1):
    model = _linear(6)
    opt = OwnerComputeOptimizer(torch.optim.AdamW, model.named_parameters())
    with pytest.raises(OwnerComputeError, match=r"got \['layout', 'rank', 'world_size'\]; it needs 'inner'"):
        opt.load_state_dict({k: v for k, v in opt.state_dict().items() if k != "inner"})  # a bare KeyError before
    with pytest.raises(OwnerComputeError, match=r"state_dict\['layout'\] is 5"):
        opt.load_state_dict({**opt.state_dict(), "layout": 5})
    shampoo = _shampoo(list(_linear(6).parameters()))
    with pytest.raises(ValueError, match=r"BlockedShampoo state_dict\['state'\]\[0\] .* list of dicts of tensors"):
        shampoo.load_state_dict({"state": {0: {"blocks": 3}}, "param_groups": shampoo.state_dict()["param_groups"]})
    with pytest.raises(OwnerComputeError, match=r"ns_steps='5'.*int >= 1"):
        Muon(model.named_parameters(), ns_steps="5")
    with pytest.raises(OwnerComputeError, match=r"not of the types torch.optim.Muon takes"):
        Muon(model.named_parameters(), lr="0.02")
