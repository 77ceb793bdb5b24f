"""FSDP2's own test scenarios (autograd, training, frozen, comm) on 2 spawned gloo ranks: stock
FSDP2 and blockshard, the same code with only ``fully_shard`` swapped, each equal to one process
(float32 tolerance of ``torch.testing.assert_close``, as FSDP2's tests; see _fsdp2_scenario_runs.py
and _fsdp2_scenario_rows.py).

The count (issue 28 item 5; torch main's test_fully_shard_{autograd,training,frozen,comm}.py read
2026-12, each test method rebuilt in our own words with tiny models): 74 test methods read; 49
portable to CPU / gloo at W = 2 and about user-visible behaviour, 25 not. Of the 49, 45 are rows
here (58 rows: some methods give several, a few rows come from other files), two more
(test_train_parity_single_group_shard_largest_dim, test_train_parity_shard_placement_fn_shard_largest_dim)
are ``shard_placement_fn_parity`` of test_fsdp2_init_scenarios.py and one
(test_train_parity_single_worldsize1: no collective on a mesh of one rank) is
test_fast_one_rank.py; all pass with both engines.
Stock FSDP2 itself fails one on gloo (test_set_reduce_scatter_divide_factor: gloo has no
``ReduceOp.PREMUL_SUM``), so it is no row: stock passes 48 of the 49, and blockshard passes those
48. The last two it passed: on a mesh of one rank it issued an all-gather, a reduce-scatter and an
all-reduce per step where FSDP2 issues none ([Note: one rank] in core/_collectives.py); and
torch's composable ``replicate`` over blockshard-sharded MLPs (test_unshard_async) aborted in gloo
("Received data size doesn't match expected size", 336 vs 288 bytes): DDP all-reduced each rank's
local pieces, whose sizes differ by rank, until blockshard modules carried ``fully_shard`` in
torch's composable registry, as FSDP2's do (replicate leaves them alone). The 25 not portable: 10 need CUDA, NCCL logs, CUDA graphs, streams or events, symmetric
memory or a CUDA kernel; 12 assert on FSDP2's private objects (FSDPParamGroup events, comm
contexts, private helpers) or a torch op that is not ``fully_shard``; 3 need 4 to 8 ranks with
tensor or expert parallelism through torch's test-internal helpers. Each method, with its row or
reason: docs/support_matrix.md, "FSDP2's own tests".

Before, blockshard failed the first seven of the older rows (an int ``reshard_after_forward``
raised, ``set_unshard_in_backward`` and ``_set_unshard_async_op`` did not exist,
``full_state_dict`` raised for a checkpoint-wrapped list group and for a group nested in
checkpoint wrappers, and torch's ``register_fsdp_forward_method`` left a blockshard module
unregistered, so its method ran on the local pieces); the last two of them import torch's
``register_fsdp_forward_method`` and ``clip_grad_norm_`` before any ``fully_shard``, as scripts
do. ``model.to(torch.float64)`` after ``fully_shard`` raised until blockshard converted its
buffers as FSDP2 converts its DTensors; ``set_reduce_scatter_max_input_buffers(2.5)`` raised a
``ShardingError`` (a ValueError) where FSDP2 raises a TypeError, until this count.
"""

from __future__ import annotations

import _fsdp2_scenario_runs
import pytest

from blockshard._launch import spawn_gloo

pytestmark = pytest.mark.slow  # in the slow tier to keep `make test-fast` under a minute


def test_fsdp2_s_scenarios_pass_with_fsdp2_and_blockshard_alike():
    results = spawn_gloo(_fsdp2_scenario_runs.all_scenarios, 2, timeout=240)
    assert results[0].keys() == _fsdp2_scenario_runs.w2_rows().keys()
    _assert_all_ok(results)


def test_fsdp2_s_int_reshard_after_forward_at_w4_passes_with_fsdp2_and_blockshard_alike():
    """At W = 4, ``reshard_after_forward=2`` is FSDP2's smaller world after forward (2 ranks), not
    True or False; 3, no factor of 4, is refused by both."""
    results = spawn_gloo(_fsdp2_scenario_runs.all_scenarios, 4, args=("W4",), timeout=240)
    assert results[0].keys() == _fsdp2_scenario_runs.SCENARIOS_W4.keys()
    _assert_all_ok(results)


def _assert_all_ok(results: list[dict[str, dict[str, str]]]) -> None:
    """Every row "ok" with both engines on every rank; else every failing row with its error."""
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
