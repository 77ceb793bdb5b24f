"""Misuse errors in-process: the cases of _misuse.py at W = 1 on the test thread's gloo group,
and the W = 2 ones (semantics shapes, a layout mismatch) on threaded gloo ranks. The spawned
versions stay in test_misuse.py (slow tier)."""

from __future__ import annotations

import _inproc
import _misuse
import pytest
from test_misuse import MISUSE_CASES
from torch import nn

import blockshard
from blockshard.runtime import LayoutMismatchError, ShardingError

pytestmark = pytest.mark.timeout(60)  # in-process ranks: a hang fails the test, never the run


@pytest.fixture(scope="module")
def outcomes(gloo_w1) -> dict:
    return _misuse.misuse(0, 1)


@pytest.mark.parametrize(("case", "expected"), MISUSE_CASES)
def test_misuse_raises_clearly_at_w1(outcomes, case, expected):
    assert expected in outcomes[case], outcomes[case]


def test_tied_weights_in_one_group_stay_tied_at_w1(outcomes):
    assert outcomes["tied_params"] == 1 and outcomes["tied_same"]


def test_unused_parameters_keep_no_gradient_and_are_not_stepped_at_w1(gloo_w1):
    assert _misuse.unused(0, 1)["unchanged"]


def test_without_a_process_group_the_error_says_how_to_start_one(gloo_w1):
    with _inproc.hidden_process_group(), pytest.raises(ShardingError, match="init_process_group"):
        blockshard.fully_shard(nn.Linear(2, 2))
    blockshard.fully_shard(nn.Linear(2, 2))  # control: with the group visible it shards


def test_layout_mismatch_raises_on_every_rank_without_hanging():
    with pytest.raises(LayoutMismatchError, match="ranks disagree on the layout of group 'Linear'") as info:
        _inproc.run_ranks(_misuse.mismatch, 2, timeout=30)
    assert "rank 0: group 'Linear' hash" in str(info.value) and "rank 1: group 'Linear' hash" in str(info.value)
    assert any("also failed: LayoutMismatchError" in note for note in info.value.__notes__)  # both ranks


def test_semantics_give_the_optimizer_block_shapes_at_w2():
    outs = _inproc.run_ranks(_misuse.semantics, 2)
    matrices = [s for out in outs for s in out["whole"] if len(s) == 2]
    assert sorted(matrices) == sorted([(37, 13), (29, 37), (8, 29)])  # whole, each on one rank
    for out in outs:
        shape = out["stripes"]
        assert shape == (0,) or (len(shape) == 2 and shape[1] == 16 and shape[0] % 4 == 0)
    assert sum(out["stripes"][0] for out in outs if len(out["stripes"]) == 2) == 12
