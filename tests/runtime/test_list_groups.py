"""``fully_shard([model.norm, lm_head])`` on spawned gloo ranks (W = 2, every rank the whole
batch): training equals one process bitwise, and a step issues as many all-gathers as FSDP2's
with the same groups ([Note: a list of modules] in blockshard/runtime/core/_list_groups.py)."""

from __future__ import annotations

import _list_runs
import pytest
import torch

from blockshard._launch import run_single, spawn_gloo

pytestmark = pytest.mark.slow


def test_a_list_group_trains_as_one_process_with_fsdp2s_all_gathers():
    want = run_single(_list_runs.reference_run, timeout=120)
    ours = spawn_gloo(_list_runs.sharded_run, 2, args=("blockshard",), timeout=240)
    theirs = spawn_gloo(_list_runs.sharded_run, 2, args=("fsdp2",), timeout=240)
    for rank, got in enumerate(ours):
        assert got["losses"] == want["losses"], rank
        assert got["state"].keys() == want["state"].keys()
        for k, v in want["state"].items():
            assert torch.equal(got["state"][k], v), (rank, k)
        assert got["layouts"] == ["", "model.layers.0", "model.layers.1", "model.norm+lm_head"]
    # per step: each layer and the list's group twice (forward, backward), the root once
    assert [r["all_gathers"] for r in ours] == [2 + 2 + 2 + 1] * 2
    assert [r["all_gathers"] for r in theirs] == [r["all_gathers"] for r in ours]
    # the control: training moved the list's tensors, so equal states are no accident of the init
    assert want["moved"] == ["lm_head.weight", "model.norm.weight"]
