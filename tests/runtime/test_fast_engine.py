"""The engine against one process, in-process: W = 1 on a real gloo group in the test thread and
W = 2 on threaded gloo ranks (see _inproc.py). The spawned versions stay in test_engine.py.

Tolerance: **bitwise** (losses of every micro-batch and parameters after 2 AdamW steps). Every
rank trains on the whole batch with one intra-op thread, so averaging identical gradients over
W in {1, 2} is exact and any difference comes from sharding (DESIGN.md, "What correct means").
Controls show the comparison can fail: a learning rate off by 1e-4, and gradients synced at the
wrong micro-batch, both differ from one process.
"""

from __future__ import annotations

import functools

import _fast_scenarios as fs
import _inproc
import pytest

pytestmark = pytest.mark.timeout(60)  # in-process ranks: a hang fails the test, never the run

KINDS = ["mlp", "llama"]


@functools.cache
def reference(kind: str, micro: int = 1) -> dict:
    with _inproc.single_thread():
        return fs.train(0, 1, kind, sharded=False, micro=micro)


def _on(world: int, *args, **kwargs) -> list[dict]:
    if world == 1:  # the test thread's own gloo group (fixture gloo_w1)
        with _inproc.single_thread():
            return [fs.train(0, 1, *args, **kwargs)]
    return _inproc.run_ranks(fs.train, world, args=args, kwargs=kwargs)


@pytest.fixture(autouse=True)
def _w1(gloo_w1):
    return gloo_w1


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_sharded_per_layer_matches_one_process_bitwise(kind, world):
    want = reference(kind)
    for rank, got in enumerate(_on(world, kind, sharded=True)):
        assert fs.bitwise_diffs(got, want) == {}, f"rank {rank} of {world}"
    if world == 2:  # and the ranks really were sharded: nobody held every element
        shapes = [tuple(s) for s in got["shapes"]]
        assert shapes != [tuple(p.shape) for p in want["params"].values()]


@pytest.mark.parametrize("kind", KINDS)
def test_control_a_slightly_different_learning_rate_is_caught(kind):
    got = _on(2, kind, sharded=True, lr=fs.LR * (1 + 1e-4))[0]
    diffs = fs.bitwise_diffs(got, reference(kind))
    assert diffs and all(not k.startswith("loss[0]") for k in diffs)  # step 1's loss is still equal
    assert max(diffs.values()) < 1e-3  # a tiny, not a gross, difference is what gets caught


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_accumulation_without_sync_matches_one_process_bitwise(kind, world):
    """set_requires_gradient_sync(False) for 2 micro-batches, True for the 3rd, then step."""
    want = reference(kind, micro=3)
    for rank, got in enumerate(_on(world, kind, sharded=True, micro=3)):
        assert fs.bitwise_diffs(got, want) == {}, f"rank {rank} of {world}"


@pytest.mark.parametrize("world", [1, 2])
def test_control_syncing_the_first_micro_batch_instead_of_the_last_differs(world):
    got = _on(world, "mlp", sharded=True, micro=3, sync_last_only=False)[0]
    assert any(not k.startswith("loss") for k in fs.bitwise_diffs(got, reference("mlp", micro=3)))
