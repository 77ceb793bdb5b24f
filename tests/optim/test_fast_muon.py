"""``blockshard.optim.Muon`` on one process is ``torch.optim.Muon``, bit for bit (fast tier)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from blockshard.optim import Muon, OwnerComputeError, OwnerComputeOptimizer


def _pair(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(12, 5, generator=g)), nn.Parameter(torch.randn(4, 9, generator=g))]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 0.02},
        {"lr": 0.05, "weight_decay": 0.0, "nesterov": False, "adjust_lr_fn": "match_rms_adamw"},
    ],
)
def test_bitwise_equal_to_torch_muon(kwargs):
    ours, theirs = _pair(), _pair()
    opt = Muon([(f"w{i}", p) for i, p in enumerate(ours)], **kwargs)
    ref = torch.optim.Muon(theirs, **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step(), ref.step()
        opt.zero_grad(), ref.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs, strict=True))
    assert all(
        torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
        for p, q in zip(ours, theirs, strict=True)
    )


def test_lr_schedulers_state_dicts_and_bad_input():
    ours = _pair()
    opt = Muon([("a", ours[0]), ("b", ours[1])], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for p in ours:
        p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.05 == opt.inner.param_groups[0]["lr"]
    sd = opt.state_dict()
    again = Muon([("a", _pair()[0]), ("b", _pair()[1])], lr=0.1)
    again.load_state_dict(sd)
    assert torch.equal(next(iter(again.state.values()))["momentum_buffer"], opt.state[ours[0]]["momentum_buffer"])
    with pytest.raises(OwnerComputeError, match=r"'bias'.*2-D"):
        Muon([("bias", nn.Parameter(torch.zeros(3)))])
    with pytest.raises(OwnerComputeError, match="callable"):
        OwnerComputeOptimizer(None, [("a", ours[0])])
