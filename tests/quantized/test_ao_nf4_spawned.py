"""torchao ``NF4Tensor`` weights against one process on spawned gloo ranks (W in {2, 3, 4}); the
threaded tier (test_fast_ao_nf4.py) states the tolerance at W = 3 (one bf16 ulp)."""

from __future__ import annotations

import functools

import _ao_runs
import pytest
from _adapters import check_equal_one_process

from blockshard._launch import run_single, spawn_gloo

pytestmark = pytest.mark.slow


@functools.cache
def reference() -> dict:
    return run_single(_ao_runs.run, args=(False,), timeout=300)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_nf4tensor_equals_one_process(world):
    want = reference()
    results = spawn_gloo(_ao_runs.run, world, args=(True,), timeout=300)
    check_equal_one_process(results, want, world)
