"""torch.distributed.pipelining over stages sharded by blockshard: its schedules drive the engine
through FSDP2's public controls and its ``REDUCE_GRAD`` through ``fully_shard.state`` ([Note:
pipelining's gradient reduction]). Spawned gloo ranks, one pipeline stage over dp = 2, or two
stages per rank for the zero-bubble schedules."""

from __future__ import annotations

import pytest
import torch
from _pipeline_runs import SCHEDULES, ZERO_BUBBLE, reference, run_all

from blockshard._launch import run_single, spawn_gloo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs():
    return spawn_gloo(run_all, 2, timeout=240)[0], run_single(reference, timeout=120)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedules_train_as_stock_fsdp2_bitwise_and_as_one_process(runs, schedule):
    got, one = runs
    ours = got[f"blockshard-{schedule}"]
    for k, v in got["stock-gpipe"].items():  # 1F1B runs the same micro-batches in another order
        assert torch.equal(ours[k], v), k
    assert _max_diff(ours, one) < 1e-6  # the micro-batches' means sum in another order than one mean


def test_control_without_the_gradient_reduction_the_run_differs(runs):
    got, one = runs
    assert _max_diff(got["control-no-reduction"], one) > 1e-3


@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
def test_zero_bubble_schedules_train_as_stock_fsdp2_bitwise_and_as_one_process(runs, schedule):
    """The weight pass assigns each unsharded parameter's ``.grad``; with the gradient views on, it
    is added to what the earlier micro-batch left in its view (before: copied over it)."""
    got, one = runs
    ours, stock = got[f"blockshard-{schedule}"], got[f"stock-{schedule}"]
    for k, v in stock.items():
        assert torch.equal(ours[k], v), k
    assert _max_diff(ours, one) < 1e-6
    if schedule == "zbv":
        views = got["blockshard-zbv-views"]
        assert all(torch.equal(views[k], v) for k, v in stock.items())


def test_zero_bubble_with_groups_resharded_after_forward_is_refused_where_stock_fsdp2_drops_gradients(runs):
    got, one = runs
    assert got["blockshard-zbv-resharded"].startswith("ShardingError"), got["blockshard-zbv-resharded"]
    assert "reshard_after_forward=False" in got["blockshard-zbv-resharded"]
    # control: stock FSDP2 silently trains only the first stage (the other's parameters never move)
    stock, start = got["stock-zbv-resharded"], _initial()
    assert torch.equal(stock["layers.2.weight"], start["layers.2.weight"])
    assert _max_diff(stock, one) > 1e-3


def _initial() -> dict[str, torch.Tensor]:
    from _pipeline_runs import _model

    return {k: v.detach().clone() for k, v in _model().state_dict().items()}
