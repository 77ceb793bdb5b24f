"""FSDP2's own init and state-dict scenarios, with stock FSDP2 and blockshard in ONE spawned W = 2
run (tests/runtime/_fsdp2_init_scenario_runs.py), each compared with one process.

Every rank gets the whole batch, so the gradient average is exact at W = 2: both engines must
match the single-process model bitwise (tolerance 0). Stock FSDP2 is the control: where it passes,
blockshard must pass the same scenario; the refusals (a forward on the meta device, a shard dim
out of range) must raise on both.
"""

from __future__ import annotations

import functools

import _fsdp2_init_scenario_runs as runs
import pytest

from blockshard._launch import spawn_gloo

pytestmark = pytest.mark.slow  # in the slow tier to keep `make test-fast` under a minute


@functools.cache
def _results() -> list[dict]:
    return spawn_gloo(runs.all_runs, 2, timeout=300)


@pytest.mark.parametrize("engine", runs.ENGINES)
def test_shard_placement_fn_trains_as_one_process(engine):
    for rank_out in _results():
        got = rank_out[engine]["placement"]
        assert (got["largest"], got["neg1"]) == (0.0, 0.0), got


def test_shard_placement_fn_out_of_range_raises_on_both_engines():
    for rank_out in _results():
        assert rank_out["fsdp2"]["placement"]["invalid"].startswith("AssertionError: Shard dim 1 is invalid")
        bs = rank_out["blockshard"]["placement"]["invalid"]
        assert bs.startswith("ShardingError: shard_placement_fn returned Shard(1) for parameter '0.bias'"), bs
        assert "Shard dim 1 is invalid for a 1D tensor. Fix: return a dim in [-1, 1)" in bs


@pytest.mark.parametrize("engine", runs.ENGINES)
def test_state_dict_entries_view_the_parameters_and_load_back(engine):
    for rank_out in _results():
        for case, facts in rank_out[engine]["save_load"].items():
            assert facts == {"names": True, "shared": True, "untouched": True, "loaded": True,
                             "same_after_forward": True}, (case, facts)  # fmt: skip


@pytest.mark.parametrize("engine", runs.ENGINES)
def test_meta_init_then_load_state_dict_assign_equals_one_process(engine):
    for rank_out in _results():
        got = rank_out[engine]["meta_assign"]
        assert got == {"on_cpu": True, "loaded": 0.0, "loss": 0.0, "stepped": 0.0}, got


@pytest.mark.parametrize("engine", runs.ENGINES)
def test_cpu_offload_on_meta_loads_entry_by_entry_with_assign(engine):
    for rank_out in _results():
        got = rank_out[engine]["offload_assign"]
        assert got == {"loss": 0.0, "loaded": 0.0, "cpu": True}, got


def test_a_forward_on_the_meta_device_raises_naming_the_parameters_on_both_engines():
    for rank_out in _results():
        assert rank_out["fsdp2"]["meta_forward"].startswith(
            "RuntimeError: FSDP parameters should be materialized from meta device"
        )
        bs = rank_out["blockshard"]["meta_forward"]
        assert bs.startswith("ShardingError: group 'MLP' runs forward with its parameters still on the meta device"), bs
        assert "'0.in_proj.weight'" in bs and "Fix: materialize the model before training: model.to_empty" in bs


def test_a_frozen_float8_parameter_beside_a_trainable_one_trains_as_one_process():
    # blockshard's all-gather of the float8 buffer failed on gloo ("Invalid scalar type") before;
    # stock FSDP2 still fails so on gloo (the control), so blockshard is compared with one process
    for rank_out in _results():
        assert rank_out["blockshard"]["fp8_frozen"] == {"trained": 0.0, "fp8": True}, rank_out["blockshard"]
        assert rank_out["fsdp2"]["fp8_frozen"].startswith("RuntimeError: Invalid scalar type")
