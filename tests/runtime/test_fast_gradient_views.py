"""Gradient views ([Note: gradient views] in blockshard/runtime/core/_grad_sync.py), in process: the
unsharded gradients are views of the reduce-scatter input, so no gradient is copied into it (the
copy counter of ``benchmarks/engine_vs_fsdp2.py``), the results are the copy path's bits, and the
setting's default and its bad values. The spawned tier runs every training configuration at
W = 2 and 4 against one process (test_gradient_views.py).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import _inproc
import pytest
import torch
from torch import nn

import blockshard
from blockshard import BlockshardError
from blockshard.runtime import ShardingError
from blockshard.runtime.core._state import state_of

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from engine_vs_fsdp2 import OpCounter

pytestmark = pytest.mark.timeout(120)


def _counted_step(views: bool | None, micro: int = 1) -> tuple[dict, dict]:
    """One model trained two steps (``micro`` micro-batches each), the views set on every group;
    the full parameters and the counter's summary of the second step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    for m in (model[0], model[2], model):
        blockshard.fully_shard(m)
    model.set_gradient_views(views)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counter = OpCounter(model)
    for step in range(2):
        with counter if step == 1 else contextlib.nullcontext():
            for k in range(micro):
                model.set_requires_gradient_sync(k == micro - 1)
                model(torch.full((3, 8), 0.5 + step + k)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return blockshard.full_state_dict(model), counter.summary()


@pytest.mark.parametrize("micro", [1, 2])
def test_views_copy_no_gradient_and_give_the_copy_paths_bits(gloo_w1, micro):
    on, seen = _counted_step(True, micro)
    off, control = _counted_step(False, micro)
    assert seen["copies"]["reduce_scatter_path"]["bytes"] == 0, seen["copies"]["reduce_scatter_path"]["ops"]
    assert seen["grad_accumulate_add"]["count"] >= 4 * micro  # autograd added into the views
    # the control: each gradient copied in once (212 fp32 values; the micro-batches summed by autograd)
    assert control["copies"]["reduce_scatter_path"]["bytes"] == 4 * (8 * 16 + 16 + 16 * 4 + 4)
    assert on.keys() == off.keys() and all(torch.equal(on[k], off[k]) for k in on)


def test_a_parameter_without_a_gradient_keeps_none_under_views(gloo_w1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    blockshard.fully_shard(model)
    model.set_gradient_views(True)
    model[0](torch.ones(2, 4)).sum().backward()  # model[1] unused
    assert all(p.grad is not None for p in model[0].parameters())
    assert all(p.grad is None for p in model[1].parameters())


def _default_and_set(rank: int, world: int) -> list[bool]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    blockshard.fully_shard(model)
    grads = state_of(model).buffers.grads
    seen = [grads.views_on()]
    model.set_gradient_views(True)
    seen.append(grads.views_on())
    model.set_gradient_views(None)
    return [*seen, grads.views_on()]


def test_the_default_is_on_where_the_backend_reduces_in_place(gloo_w1):
    """gloo clones every reduce-scatter input at W > 1 ([Note: gloo's copies]): views off there by
    default; at W = 1 nothing is cloned."""
    with _inproc.single_thread():
        assert _default_and_set(0, 1) == [True, True, True]
    assert _inproc.run_ranks(_default_and_set, 2) == [[False, True, False]] * 2


def test_bad_settings_are_refused_by_name(gloo_w1, monkeypatch):
    model = nn.Linear(4, 4)
    blockshard.fully_shard(model)
    with pytest.raises(ShardingError, match=r"set_gradient_views\(gradient_views='yes'\): pass True, False or None"):
        model.set_gradient_views("yes")
    monkeypatch.setenv("BLOCKSHARD_GRADIENT_VIEWS", "on")
    with pytest.raises(BlockshardError, match=r"BLOCKSHARD_GRADIENT_VIEWS='on' must be 1 .* or unset"):
        blockshard.fully_shard(nn.Linear(4, 4))
