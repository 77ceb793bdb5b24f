"""Collectives that do not line up raise on every rank ([Note: collective integrity] in
blockshard/runtime/_collectives.py); spawned gloo ranks, W = 2.

Covered today: ranks whose requires_grad flags differ train equal-sized collectives that pair up
silently; the end-of-step check makes both raise before the optimizer step uses the gradients.
Not yet bounded: a rank that skips a step, runs an extra forward or leaves a module unused can
block its peer inside gloo's reduce-scatter, which gloo runs inline (its wait timeout does not
apply), so that peer waits for the process group's own timeout.
"""

from __future__ import annotations

import _integrity
import pytest

from blockshard._launch import spawn_gloo

pytestmark = pytest.mark.slow


def test_differing_requires_grad_raises_on_every_rank_before_the_optimizer_step():
    results = spawn_gloo(_integrity.case, 2, args=("requires_grad",), timeout=120)
    for rank, res in enumerate(results):
        assert res["outcome"].startswith("CollectiveIntegrityError: blockshard: the ranks' collectives"), (
            rank,
            res["outcome"],
        )
        assert "requires_grad flags" in res["outcome"] and "Fix: run the same forward and backward" in res["outcome"]
        assert res["seconds"] < 3 * _integrity.TIMEOUT_S


def test_control_aligned_ranks_train_without_error():
    for res in spawn_gloo(_integrity.case, 2, args=("none",), timeout=120):
        assert res["outcome"] == "no error"
