"""FSDP2's own test scenarios (autograd, training, frozen, comm) on 2 spawned gloo ranks: stock
FSDP2 and blockshard, the same code with only ``fully_shard`` swapped, each equal to one process
(float32 tolerance of ``torch.testing.assert_close``, as FSDP2's tests; see _fsdp2_scenario_runs.py).

Stock FSDP2 passes every scenario here on gloo / CPU too, so each row is a parity check: blockshard
failed the first seven before (an int ``reshard_after_forward`` raised, ``set_unshard_in_backward``
and ``_set_unshard_async_op`` did not exist, ``full_state_dict`` raised for a checkpoint-wrapped
list group and for a group nested in checkpoint wrappers, and torch's
``register_fsdp_forward_method`` left a blockshard module unregistered, so its method ran on the
local pieces); the last two of them import torch's ``register_fsdp_forward_method`` and
``clip_grad_norm_`` before any ``fully_shard``, as scripts do (before blockshard rerouted torch's
function objects themselves, those names kept torch's: the method ran on local pieces and the norm
was the local one). The last row, ``model.to(torch.float64)`` after ``fully_shard``, raised until
blockshard converted its buffers as FSDP2 converts its DTensors.
"""

from __future__ import annotations

import _fsdp2_scenario_runs
import pytest

from blockshard._launch import spawn_gloo

pytestmark = pytest.mark.slow  # in the slow tier to keep `make test-fast` under a minute


def test_fsdp2_s_scenarios_pass_with_fsdp2_and_blockshard_alike():
    results = spawn_gloo(_fsdp2_scenario_runs.all_scenarios, 2, timeout=240)
    assert results[0].keys() == _fsdp2_scenario_runs.SCENARIOS.keys()
    failed = {
        (rank, name, engine): outcome
        for rank, rows in enumerate(results)
        for name, row in rows.items()
        for engine, outcome in row.items()
        if outcome != "ok"
    }
    assert not failed, "\n".join(f"rank {r} {n!r} [{e}]: {o}" for (r, n, e), o in failed.items())


def test_fsdp2_s_int_reshard_after_forward_at_w4_passes_with_fsdp2_and_blockshard_alike():
    """At W = 4, ``reshard_after_forward=2`` is FSDP2's smaller world after forward (2 ranks), not
    True or False; 3, no factor of 4, is refused by both."""
    results = spawn_gloo(_fsdp2_scenario_runs.all_scenarios, 4, args=("W4",), timeout=240)
    assert results[0].keys() == _fsdp2_scenario_runs.SCENARIOS_W4.keys()
    failed = {
        (rank, name, engine): outcome
        for rank, rows in enumerate(results)
        for name, row in rows.items()
        for engine, outcome in row.items()
        if outcome != "ok"
    }
    assert not failed, "\n".join(f"rank {r} {n!r} [{e}]: {o}" for (r, n, e), o in failed.items())


def test_the_checkpoint_prefix_blockshard_drops_is_torch_s():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    from blockshard.runtime.core import _inspect

    assert _inspect._CHECKPOINT_PREFIX == _CHECKPOINT_PREFIX
