"""FSDP2's communication controls on a blockshard module ([Note: communication controls] in
blockshard/runtime/core/_module_comms.py), on threaded gloo ranks, every rank the whole batch
unless a test says otherwise: the all-reduce hook, sum-only reductions, gradients for parameters a
rank did not use, the accepted tuning knobs and the refused custom collectives."""

from __future__ import annotations

import _inproc
import pytest
import torch
from torch import nn

import blockshard
from blockshard.runtime import CollectiveIntegrityError, ShardingError, group_layouts

pytestmark = pytest.mark.timeout(120)


def _model() -> nn.Module:
    with _inproc.serial():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    blockshard.fully_shard(model[0])
    blockshard.fully_shard(model)
    return model


def _grads(rank: int, world: int, control: str) -> dict:
    """One backward with ``control`` set on every group; the sharded gradients by name and the
    hook's calls."""
    model, calls = _model(), []
    for m in (model[0], model):
        if control == "hook":
            m.set_all_reduce_hook(lambda out: (calls.append(out.clone()), out.mul_(2)))
        elif control == "force_sum_seen":  # the hook sees the output before the engine divides it
            m.set_force_sum_reduction_for_comms(True)
            m.set_all_reduce_hook(lambda out: calls.append(out.clone()))
        elif control == "seen":
            m.set_all_reduce_hook(lambda out: calls.append(out.clone()))
        elif control == "force_sum":
            m.set_force_sum_reduction_for_comms(True)
        elif control == "knobs":  # accepted, nothing to change
            m.set_reduce_scatter_max_input_buffers(2)
            m.set_separate_reduce_scatter_group(True)
            m.set_allocate_memory_from_process_group_for_comm(True)
            m.set_symm_mem_for_comm("NCCL")
    model(torch.linspace(-1, 1, 24).view(4, 6)).square().mean().backward()
    segments = sorted(layout.segment_numel for layout in group_layouts(model).values())
    return {"grads": {n: p.grad.clone() for n, p in model.named_parameters()}, "calls": calls, "segments": segments}


def test_the_all_reduce_hook_sees_each_reduced_output_before_it_becomes_the_gradient():
    plain = _inproc.run_ranks(_grads, 2, args=("none",))
    hooked = _inproc.run_ranks(_grads, 2, args=("hook",))
    for p, h in zip(plain, hooked, strict=True):
        assert p["grads"].keys() == h["grads"].keys()
        assert all(torch.equal(h["grads"][n], 2 * p["grads"][n]) for n in p["grads"])
        assert len(h["calls"]) == 2  # once per group with parameters (the root's and model[0]'s)
        assert sorted(c.numel() for c in h["calls"]) == h["segments"]  # each group's whole segment


@pytest.mark.parametrize("control", ["force_sum", "knobs"])
def test_sum_only_reductions_and_the_accepted_knobs_give_the_same_bits(control):
    plain = _inproc.run_ranks(_grads, 2, args=("none",))
    other = _inproc.run_ranks(_grads, 2, args=(control,))
    for p, o in zip(plain, other, strict=True):
        assert all(torch.equal(o["grads"][n], p["grads"][n]) for n in p["grads"])


def test_sum_only_reductions_sum_then_divide():
    """The check that sum-only runs differ inside: the hook sees the sum of the two ranks'
    (identical) gradients, twice the average it sees otherwise; the engine divides afterwards."""
    avg = _inproc.run_ranks(_grads, 2, args=("seen",))
    summed = _inproc.run_ranks(_grads, 2, args=("force_sum_seen",))
    for a, s in zip(avg, summed, strict=True):
        assert len(a["calls"]) == len(s["calls"]) == 2
        assert all(torch.equal(y, 2 * x) for x, y in zip(a["calls"], s["calls"], strict=True))


class _TwoBranches(nn.Module):
    """Rank 0 runs branch ``a``, rank 1 branch ``b`` (control flow that differs between ranks, as a
    mixture of experts' routing)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 5)

    def forward(self, x: torch.Tensor, branch: str) -> torch.Tensor:
        return getattr(self, branch)(x)


def _x() -> torch.Tensor:
    return torch.linspace(-1, 1, 15).view(3, 5)


def _branches(rank: int, world: int, unused: bool) -> dict:
    with _inproc.serial():
        torch.manual_seed(0)
        model = _TwoBranches()
    blockshard.fully_shard(model)
    model.set_reduce_scatter_unused_params(unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(_x(), "ab"[rank]).square().mean().backward()
    opt.step()
    return blockshard.full_state_dict(model)


def _branches_reference() -> dict:
    """One process: the average of the two ranks' losses (each gradient halved, as the average of
    one rank's gradient and the other's zeros)."""
    torch.manual_seed(0)
    model = _TwoBranches()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ((model(_x(), "a").square().mean() + model(_x(), "b").square().mean()) / 2).backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_parameters_a_rank_did_not_use_get_the_reduced_gradient_when_asked():
    want = _branches_reference()
    for got in _inproc.run_ranks(_branches, 2, args=(True,)):
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_control_ranks_that_differ_in_which_parameters_got_a_gradient_are_refused():
    """Without the setting, the rank that did not use a branch would leave its piece of it unstepped
    while the other steps its own: the end-of-step check refuses that on every rank, naming the fix."""
    with pytest.raises(
        CollectiveIntegrityError,
        match=r"parameters with a gradient \(differ\).*set_reduce_scatter_unused_params\(True\)",
    ):
        _inproc.run_ranks(_branches, 2, args=(False,))


def test_bad_arguments_and_custom_collectives_are_refused_by_name(gloo_w1):
    model = _model()
    cases = [
        (lambda: model.set_all_reduce_hook(3), r"set_all_reduce_hook\(hook=3\): pass a callable"),
        (lambda: model.set_force_sum_reduction_for_comms(1), r"set_force_sum_reduction_for_comms\(enable=1\)"),
        (lambda: model.set_reduce_scatter_unused_params("yes"), r"reduce_scatter_unused_params='yes'"),
        (lambda: model.set_reduce_scatter_max_input_buffers(0), r"max_input_buffers=0\): pass an int >= 1"),
        (lambda: model.set_symm_mem_for_comm("gloo"), r"backend='gloo'\): only 'NCCL'"),
        (lambda: model.set_custom_all_gather(object()), r"set_custom_all_gather: .* Fix: leave it unset"),
        (lambda: model.set_custom_reduce_scatter(object()), r"set_custom_reduce_scatter: .* Fix: leave it unset"),
    ]
    for call, message in cases:
        with pytest.raises(ShardingError, match=message):
            call()
    for bad in (True, 2.5):  # not a count: a TypeError, as FSDP2's
        with pytest.raises(TypeError, match=rf"max_input_buffers={bad!r}\): pass an int >= 1"):
            model.set_reduce_scatter_max_input_buffers(bad)


def test_every_public_method_of_fsdp2s_module_exists():
    """FSDP2 code calls any of ``FSDPModule``'s methods (23 on torch 2.13 and 2.14): each exists on
    a blockshard module, so it behaves as FSDP2's, is accepted with a documented reason, or raises
    naming why."""
    from torch.distributed.fsdp import FSDPModule

    from blockshard.runtime import ShardedModule

    public = {n for n in dir(FSDPModule) if not n.startswith("_") and n not in dir(nn.Module)}
    assert len(public) >= 23 and public - set(dir(ShardedModule)) == set()
