"""The in-process harness itself: threaded gloo ranks return, fail and time out as documented."""

from __future__ import annotations

import time

import _inproc
import pytest
import torch
import torch.distributed as dist

import blockshard

pytestmark = pytest.mark.timeout(60)  # in-process ranks: a hang fails the test, never the run


def _facts(rank: int, world: int, value: float) -> dict:
    everyone: list = [None] * world
    dist.all_gather_object(everyone, ("rank", rank), group=dist.group.WORLD)
    out = torch.empty(3)
    dist.reduce_scatter_single(out, torch.full((3 * world,), value), op=dist.ReduceOp.AVG)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "objects": everyone,
        "avg": out,
    }


@pytest.mark.heavy  # in process, seconds: out of `make test-fast` (its one-minute budget)
def test_threaded_ranks_have_their_own_real_gloo_default_group():
    outs = _inproc.run_ranks(_facts, 2, args=(1 / 3,))
    assert [o["rank"] for o in outs] == [0, 1] and all(o["world"] == 2 for o in outs)
    assert all(o["backend"] == "gloo" for o in outs)
    assert all(o["objects"] == [("rank", 0), ("rank", 1)] for o in outs)
    # gloo's AVG of two identical values is exact: the basis of the bitwise tests at W = 2
    assert all(torch.equal(o["avg"], torch.full((3,), 1 / 3)) for o in outs)


@pytest.mark.heavy  # in process, seconds: out of `make test-fast` (its one-minute budget)
def test_the_test_thread_keeps_its_own_world(gloo_w1):
    _inproc.run_ranks(_facts, 2, args=(0.0,))
    assert dist.is_initialized() and dist.get_world_size() == 1
    with _inproc.hidden_process_group():
        assert not dist.is_initialized()
    assert dist.group.WORLD is gloo_w1


def _one_rank_fails(rank: int, world: int, shard: bool) -> None:
    if shard:
        model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
        blockshard.fully_shard(model[0])
        blockshard.fully_shard(model)  # the engine now holds the group (see _inproc's docstring)
    if rank == 1:
        raise KeyError("rank 1 gave up")
    dist.all_reduce(torch.ones(4))  # blocks until rank 1's group is freed or gloo times out


def test_a_failing_rank_reaches_the_test_and_releases_its_peers_at_once():
    start = time.monotonic()
    with pytest.raises(KeyError, match="rank 1 gave up") as info:
        _inproc.run_ranks(_one_rank_fails, 2, args=(False,), gloo_timeout_s=30)
    assert time.monotonic() - start < 5  # far below the 30 s gloo timeout: no waiting it out
    notes = "\n".join(info.value.__notes__)
    assert "raised on rank 1 of 2" in notes and "rank 0 also failed" in notes


def test_a_failing_rank_holding_a_sharded_model_releases_its_peers_at_once():
    """The engine's state lives on the module: dropping the model frees its process group."""
    start = time.monotonic()
    with pytest.raises(KeyError, match="rank 1 gave up"):
        _inproc.run_ranks(_one_rank_fails, 2, args=(True,), gloo_timeout_s=30)
    assert time.monotonic() - start < 5  # far below the 30 s gloo timeout


def _rank_one_dawdles(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(1.5)
    return rank


def test_a_rank_past_the_timeout_raises_timeout_error():
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 did not finish within timeout=0.3 s"):
        _inproc.run_ranks(_rank_one_dawdles, 2, timeout=0.3)


def test_collective_log_sees_the_c10d_ops_of_its_own_thread():
    def fn(rank, world):
        with _inproc.CollectiveLog() as log:
            dist.all_gather_single(torch.empty(2 * world), torch.ones(2))
            dist.reduce_scatter_single(torch.empty(2), torch.ones(2 * world))
            dist.all_reduce(torch.ones(1))
        return [k for k, _ in log.events]

    assert _inproc.run_ranks(fn, 2) == [["all_gather", "reduce_scatter", "all_reduce"]] * 2
