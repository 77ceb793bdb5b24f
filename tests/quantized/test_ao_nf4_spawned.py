"""torchao ``NF4Tensor`` weights against one process on spawned gloo ranks (W in {2, 3, 4}); the
threaded tier (test_fast_ao_nf4.py) states the tolerance at W = 3 (one bf16 ulp)."""

from __future__ import annotations

import functools

import _ao_runs
import pytest
import torch

from blockshard._launch import run_single, spawn_gloo

pytestmark = pytest.mark.slow


@functools.cache
def reference() -> dict:
    return run_single(_ao_runs.run, args=(False,), timeout=300)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_nf4tensor_equals_one_process(world):
    want = reference()
    results = spawn_gloo(_ao_runs.run, world, args=(True,), timeout=300)
    for rank, got in enumerate(results):
        assert torch.equal(got["logits"], want["logits"]), rank
        for key in ("grads", "params") if world != 3 else ("grads",):
            for n, w in want[key].items():
                if world == 3:
                    torch.testing.assert_close(got[key][n], w, rtol=2**-7, atol=1e-6)
                else:
                    assert torch.equal(got[key][n], w), (rank, key, n)
    assert sum(r["held"] for r in results) == results[0]["total"]
