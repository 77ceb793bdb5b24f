"""blockshard._launch: W spawned gloo ranks with real collectives; failures and hangs never hang the caller."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from blockshard._launch import START_METHOD_ENV, run_single, spawn_gloo


# Rank functions: top-level so that spawned processes can unpickle them.
def _collectives(rank: int, world_size: int, scale: float):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    gathered = torch.empty(world_size * 3)
    dist.all_gather_into_tensor(gathered, torch.full((3,), rank * scale))
    return {
        "rank": rank,
        "world": dist.get_world_size(),
        "sum": t.item(),
        "gathered": gathered,
        "threads": torch.get_num_threads(),
    }


def _raise_in_rank_1(rank: int, world_size: int):
    if rank == 1:
        raise ValueError("injected failure 4711")
    dist.all_reduce(torch.ones(1))  # rank 1 never gets here: rank 0 must not hang
    return rank


def _sleep_in_rank_0(rank: int, world_size: int):
    if rank == 0:
        time.sleep(1000)
    return rank


def _collective_rank_1_never_joins(rank: int, world_size: int):
    if rank == 1:
        time.sleep(1000)
    dist.all_reduce(torch.ones(1))
    return rank


def _exit_in_rank_1(rank: int, world_size: int):
    if rank == 1:
        os._exit(3)
    return rank


def _no_group(rank: int, world_size: int, x: torch.Tensor):
    return rank, world_size, dist.is_initialized(), torch.get_num_threads(), x * 2


def _env_and_cwd(rank: int, world_size: int):
    return os.environ.get("BLOCKSHARD_TEST_MARK"), os.getcwd(), dist.get_world_size()


def _no_rank_processes_left() -> bool:
    return not [p for p in multiprocessing.active_children() if p.name.startswith("blockshard-rank")]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 3])
def test_results_in_rank_order_with_real_collectives(world_size):
    out = spawn_gloo(_collectives, world_size, args=(10.0,), timeout=60)
    assert [o["rank"] for o in out] == list(range(world_size))
    expected = torch.arange(world_size, dtype=torch.float32).repeat_interleave(3) * 10.0
    for o in out:
        assert o["world"] == world_size
        assert o["sum"] == sum(range(world_size))
        assert torch.equal(o["gathered"], expected)  # tensors come back by value
        assert o["threads"] == 1


@pytest.mark.slow
def test_exception_in_rank_1_surfaces_with_traceback():
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        spawn_gloo(_raise_in_rank_1, 2, timeout=60)
    msg = str(info.value)
    assert msg.startswith("rank 1 of 2 failed"), msg
    assert "ValueError: injected failure 4711" in msg and "Traceback" in msg and "_raise_in_rank_1" in msg
    assert time.monotonic() - start < 30
    assert _no_rank_processes_left()


@pytest.mark.slow
def test_rank_that_never_finishes_raises_timeout_error():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0") as info:
        spawn_gloo(_sleep_in_rank_0, 2, timeout=6)
    assert "timeout=6" in str(info.value)
    assert 6 <= time.monotonic() - start < 20
    assert _no_rank_processes_left()


@pytest.mark.slow
def test_collective_that_a_rank_never_joins_does_not_hang():
    # gloo's own timeout is 0.9 * timeout after init: whichever fires first, the call returns with a
    # clear error (a rank's gloo "Timed out" RuntimeError, or TimeoutError from the parent).
    start = time.monotonic()
    with pytest.raises((RuntimeError, TimeoutError)) as info:
        spawn_gloo(_collective_rank_1_never_joins, 2, timeout=8)
    msg = str(info.value)
    if isinstance(info.value, RuntimeError):
        assert msg.startswith("rank 0 of 2 failed") and "Timed out" in msg and "[1] had not finished" in msg, msg
    else:
        assert "ranks [0, 1]" in msg, msg
    assert time.monotonic() - start < 25
    assert _no_rank_processes_left()


@pytest.mark.slow
def test_rank_that_dies_without_result_is_reported():
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3"):
        spawn_gloo(_exit_in_rank_1, 2, timeout=60)


@pytest.mark.slow
def test_run_single_has_no_group_and_sets_threads():
    rank, world, initialized, threads, y = run_single(_no_group, args=(torch.arange(3.0),), threads=2)
    assert (rank, world, initialized, threads) == (0, 1, False, 2)
    assert torch.equal(y, torch.tensor([0.0, 2.0, 4.0]))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"world_size": 0}, "world_size=0"),
        ({"world_size": -2}, "world_size=-2"),
        ({"world_size": "2"}, "world_size='2'"),
        ({"fn": 42}, "fn=42"),
        ({"fn": lambda rank, world_size: rank}, "fn="),
        ({"threads": 0}, "threads=0"),
        ({"timeout": 0}, "timeout=0"),
        ({"args": [1]}, "args=[1]"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, needle):
    call = {"fn": _collectives, "world_size": 2, **kwargs}
    fn, world_size = call.pop("fn"), call.pop("world_size")
    with pytest.raises(ValueError) as info:
        spawn_gloo(fn, world_size, **call)
    assert needle in str(info.value)
    assert _no_rank_processes_left()


def test_run_single_rejects_non_callable():
    with pytest.raises(ValueError, match="fn='x'"):
        run_single("x")


def test_import_blockshard_does_not_import_launch():
    code = "import sys, blockshard; print('blockshard._launch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_each_start_method_gives_the_ranks_the_callers_environment_and_directory(method, monkeypatch, tmp_path):
    # The forkserver forks ranks from a server started at its first run, whose variables are those of
    # that moment: each rank must see the caller's as of this call (the suite sets forkserver).
    monkeypatch.setenv(START_METHOD_ENV, method)
    if method == "forkserver":
        spawn_gloo(_env_and_cwd, 2, timeout=120)  # the server exists before the variable is set
    monkeypatch.setenv("BLOCKSHARD_TEST_MARK", f"{method}-{time.time()}")
    monkeypatch.chdir(tmp_path)
    got = spawn_gloo(_env_and_cwd, 2, timeout=120)
    assert got == [(os.environ["BLOCKSHARD_TEST_MARK"], str(tmp_path), 2)] * 2
    assert _no_rank_processes_left()


def test_an_unknown_start_method_raises_value_error(monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match=f"{START_METHOD_ENV}='fork'.*'spawn'.*'forkserver'"):
        spawn_gloo(_collectives, 2, args=(1.0,))
