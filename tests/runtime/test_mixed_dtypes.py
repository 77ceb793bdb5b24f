"""Mixed dtypes in one group ([Note: mixed dtypes] in blockshard/runtime/core/_dtypes.py) on spawned gloo
ranks (W = 2, every rank the whole batch): a tiny Llama whose attention is frozen bf16, each layer
one group of fp32 and bf16 parameters, trains as one process bitwise; under
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` it trains as FSDP2 does, bitwise."""

from __future__ import annotations

import _mixed_runs
import pytest
import torch

from blockshard._launch import run_single, spawn_gloo

pytestmark = pytest.mark.slow


def _equal(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k].to(b[k].dtype), b[k])]


def test_mixed_dtype_groups_train_as_one_process_and_as_fsdp2_under_mixed_precision():
    single = run_single(_mixed_runs.run, args=("single", False), timeout=120)
    ours = spawn_gloo(_mixed_runs.run, 2, args=("blockshard", False), timeout=240)
    for got in ours:
        assert got["losses"] == single["losses"] and _equal(got["state"], single["state"]) == []
    ours_mp = spawn_gloo(_mixed_runs.run, 2, args=("blockshard", True), timeout=240)
    theirs_mp = spawn_gloo(_mixed_runs.run, 2, args=("fsdp2", True), timeout=240)
    for a, b in zip(ours_mp, theirs_mp, strict=True):
        assert a["losses"] == b["losses"] and _equal(a["state"], b["state"]) == []
    # the control: bf16 compute changes the result, so the equalities above are not vacuous
    assert ours_mp[0]["losses"] != single["losses"]
