"""Unsupported use raises a clear error on every rank (never a hang); semantics shape the pieces."""

from __future__ import annotations

import functools

import _misuse
import pytest
from torch import nn

import blockshard
from blockshard._launch import spawn_gloo
from blockshard.runtime import ShardingError

pytestmark = pytest.mark.slow


@functools.cache
def outcomes() -> list[dict]:
    return spawn_gloo(_misuse.misuse, 2, timeout=120)


MISUSE_CASES = [  # also run in-process at W = 1 by test_fast_misuse.py
    ("twice", "ShardingError: this Linear is already sharded"),
    ("top_down", "fully_shard was applied top-down. Fix: apply it bottom-up"),
    ("shared", "parameter '1.weight' is shared with a module already sharded in another group"),
    ("non_contiguous", "parameter 'weight' of shape (6, 4) is not contiguous"),
    ("bad_mesh", "mesh='world' must be None, a 1-D DeviceMesh or a ProcessGroup"),
    ("bad_semantics", "semantics 'nf4' cannot divide tensor 'weight' of shape (5, 3)"),
]


@pytest.mark.parametrize(("case", "expected"), MISUSE_CASES)
def test_misuse_raises_clearly(case, expected):
    for rank_out in outcomes():
        assert expected in rank_out[case], rank_out[case]


def test_tied_weights_in_one_group_stay_tied():
    for rank_out in outcomes():
        assert rank_out["tied_params"] == 1 and rank_out["tied_same"]


def test_layout_mismatch_raises_on_every_rank_without_hanging():
    with pytest.raises(RuntimeError) as info:
        spawn_gloo(_misuse.mismatch, 2, timeout=120)
    msg = str(info.value)
    assert "LayoutMismatchError" in msg and "ranks disagree on the layout of group 'Linear'" in msg
    assert "rank 0" in msg and "rank 1" in msg


def test_semantics_give_the_optimizer_block_shapes():
    outs = spawn_gloo(_misuse.semantics, 2, timeout=120)
    matrices = [s for out in outs for s in out["whole"] if len(s) == 2]
    # matrix semantics: every weight is whole on exactly one rank (what Muon needs), never a slice
    assert sorted(matrices) == sorted([(37, 13), (29, 37), (8, 29)])
    for out in outs:
        # rows:4 on a 12 x 16 weight: each rank holds whole 4-row stripes, kept 2-D (or nothing)
        shape = out["stripes"]
        assert shape == (0,) or (len(shape) == 2 and shape[1] == 16 and shape[0] % 4 == 0)
    assert sum(out["stripes"][0] for out in outs if len(out["stripes"]) == 2) == 12


def test_without_a_process_group_the_error_says_how_to_start_one():
    with pytest.raises(ShardingError, match="init_process_group"):
        blockshard.fully_shard(nn.Linear(2, 2))


def test_unused_parameters_keep_no_gradient_and_are_not_stepped():
    for out in spawn_gloo(_misuse.unused, 2, timeout=120):
        assert out["unchanged"]
