"""Meta-device init ([Note: meta init] in blockshard/runtime/core/_init.py) on spawned gloo ranks:
the initial values equal unsharded init with the same seed, bitwise, at W = 2, 3 and 4, with
element-wise and whole-matrix layouts; training from them equals one process bitwise (every rank
the whole batch) at W = 2 and 4, within 1e-6 at W = 3 (the average of three equal gradients is
off by an ulp in places, see docs/design.md)."""

from __future__ import annotations

import functools

import _meta_runs
import pytest
import torch

from blockshard._launch import run_single, spawn_gloo

pytestmark = pytest.mark.slow


@functools.cache
def _reference() -> dict:
    return run_single(_meta_runs.reference_run, timeout=120)


@functools.cache
def _sharded(world: int) -> list[dict]:
    return spawn_gloo(_meta_runs.sharded_run, world, timeout=180)


@pytest.mark.parametrize("semantics", [None, "matrix"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_meta_init_equals_unsharded_init_and_trains_as_one_process(world, semantics):
    want = _reference()
    for rank, per_rank in enumerate(_sharded(world)):
        got = per_rank[semantics]
        assert got["init"].keys() == want["init"].keys()
        assert all(torch.equal(got["init"][k], v) for k, v in want["init"].items()), rank
        for k, v in want["trained"].items():
            if world == 3:
                torch.testing.assert_close(got["trained"][k], v, rtol=0, atol=1e-6)
            else:
                assert torch.equal(got["trained"][k], v), (rank, k)
