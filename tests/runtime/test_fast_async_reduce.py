"""The reduce-scatter is asynchronous ([Note: async reduce-scatter] in _grad_sync.py), in-process.

A group's reduce-scatter is issued when its backward is over and waited for at the next group's
post-backward (so it overlaps that group's backward compute, and at most one reduce-scatter input
is alive, as FSDP2's default ``reduce_scatter_max_input_buffers=1``), or in the final callback for
the last one; every sharded ``.grad`` is set when ``backward()`` returns. The values are
unchanged: the bitwise tests of test_fast_engine.py / test_engine.py cover that.

Memory ([Note: gloo's copies] in _collectives.py): on gloo (W = 2) the engine's reduce-scatter
input is freed as soon as the collective is issued (gloo works on a copy of its own), and a
backward prefetch is complete before the backward it precedes computes; at W = 1 (no copies)
the input stays alive until the wait and the prefetch stays in flight: the control.
"""

from __future__ import annotations

import threading
import time

import _inproc
import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

import blockshard
from blockshard._tiny import OddMLP
from blockshard.runtime.core import _collectives, _grad_sync
from blockshard.runtime.core._buffers import ParamBuffers
from blockshard.runtime.core._collectives import engine_group, reduce_scatter_avg
from blockshard.runtime.core._common import ShardedState
from blockshard.runtime.core._root import RootContext

pytestmark = pytest.mark.timeout(60)


def _spy(monkeypatch, inputs: dict) -> dict[int, list[tuple[str, object]]]:
    """Log, per rank, the reduce-scatters issued and waited for (by group path), the final
    callback's start and the backward compute of each block (the gradient of its first Linear's
    output); ``inputs[rank][path]``: a weak reference to the storage of the group's last
    reduce-scatter input."""
    logs: dict[int, list[tuple[str, object]]] = {}
    current: dict[int, str | None] = {}

    def log(kind: str, what: object) -> None:
        logs.setdefault(dist.get_rank(), []).append((kind, what))

    def wrap(name: str):
        orig = getattr(ParamBuffers, name)

        def method(self, *a, **k):
            current[dist.get_rank()] = self.path
            return orig(self, *a, **k)

        monkeypatch.setattr(ParamBuffers, name, method)

    wrap("reduce_grads")
    wrap("finish_reduce")
    issue, wait = _grad_sync.reduce_scatter_avg, _grad_sync.wait

    def spy_issue(*a, **k):
        log("rs_issue", current[dist.get_rank()])
        inputs.setdefault(dist.get_rank(), {})[current[dist.get_rank()]] = StorageWeakRef(a[1].untyped_storage())
        return issue(*a, **k)

    def spy_wait(work, what, pg):
        if "reduce-scatter" in what:
            log("rs_wait", current[dist.get_rank()])
        return wait(work, what, pg)

    monkeypatch.setattr(_grad_sync, "reduce_scatter_avg", spy_issue)
    monkeypatch.setattr(_grad_sync, "wait", spy_wait)
    final = RootContext.final_callback

    def spy_final(self):
        log("final_callback", None)
        return final(self)

    monkeypatch.setattr(RootContext, "final_callback", spy_final)
    return logs


def _run(rank: int, world: int, logs: dict, inputs: dict) -> dict:
    with _inproc.serial():
        model = OddMLP()
    for block in model.blocks:
        blockshard.fully_shard(block)
    blockshard.fully_shard(model)
    memory: list[tuple[int, bool | None, ShardedState | None]] = []  # at block i's backward compute

    def computing(i: int) -> None:
        logs.setdefault(dist.get_rank(), []).append(("compute", i))
        later = inputs.get(rank, {}).get(f"blocks.{i + 1}")  # its reduce-scatter is in flight now
        earlier = model.blocks[i - 1]._blockshard_state.buffers.sharded_state if i else None  # prefetched
        memory.append((i, None if later is None else later.expired(), earlier))

    for i, block in enumerate(model.blocks):

        def hook(_m, _inp, out, i=i):
            out.register_hook(lambda g: computing(i))

        block[0].register_forward_hook(hook)
    x = torch.randn(6, 13, generator=torch.Generator().manual_seed(0))
    for _step in range(2):
        logs.pop(rank, None)
        memory.clear()
        model(x).square().mean().backward()
        logs.setdefault(rank, []).append(("backward_returned", None))
        in_flight = [st.buffers.reducing for st in model._blockshard_state.ctx.states]
        grads = [p.grad is not None for p in model.parameters() if p.numel()]
        model.zero_grad()
    return {"events": logs[rank], "in_flight": in_flight, "grads": grads, "memory": memory}


@pytest.mark.parametrize("world", [1, 2])
def test_reduce_scatter_overlaps_the_next_blocks_backward(gloo_w1, monkeypatch, world):
    inputs: dict = {}
    logs = _spy(monkeypatch, inputs)
    if world == 1:
        with _inproc.single_thread():
            results = [_run(0, 1, logs, inputs)]
    else:
        results = _inproc.run_ranks(_run, world, args=(logs, inputs))
    for rank, got in enumerate(results):
        ev = got["events"]  # step 2: the prefetch order is known
        at = {e: i for i, e in enumerate(ev)}
        rs = [e for e in ev if e[0].startswith("rs_")]
        assert rs == [
            ("rs_issue", "blocks.2"),
            ("rs_wait", "blocks.2"),
            ("rs_issue", "blocks.1"),
            ("rs_wait", "blocks.1"),
            ("rs_issue", "blocks.0"),
            ("rs_wait", "blocks.0"),
        ], f"rank {rank}: {ev}"
        # block k's reduce-scatter is in flight while block k - 1 computes its backward
        assert at[("rs_issue", "blocks.2")] < at[("compute", 1)] < at[("rs_wait", "blocks.2")], ev
        assert at[("rs_issue", "blocks.1")] < at[("compute", 0)] < at[("rs_wait", "blocks.1")], ev
        # the first block (its input needs no gradient) finishes in the final callback, where
        # every reduce-scatter left is waited for, before backward returns
        assert at[("final_callback", None)] < at[("rs_wait", "blocks.1")], ev
        assert at[("rs_wait", "blocks.0")] < at[("backward_returned", None)], ev
        assert not any(got["in_flight"]) and all(got["grads"]), got
        # [Note: gloo's copies] while block i computes its backward: block i + 1's reduce-scatter
        # input is freed (gloo, W = 2: the work owns a copy) or alive until the wait (W = 1), and
        # block i - 1, prefetched when block i's backward began, is gathered (W = 2) or in flight
        # (block 2's mark comes before its pre-backward: its Linear's output is the block's output)
        copies = world > 1
        assert [m[:2] for m in got["memory"]] == [(2, None), (1, copies), (0, copies)], got["memory"]
        assert got["memory"][1][2] is (ShardedState.UNSHARDED if copies else ShardedState.UNSHARDING), got["memory"]


PEER_WAIT_S = 10.0  # how long the peer holds back its half for rank 0's call to return


def test_gloo_reduce_scatter_is_issued_without_waiting_for_the_peer(gloo_w1):
    """Measured on torch 2.13's gloo: ``reduce_scatter_single(async_op=True)`` on the engine's
    group returns before the peer has issued its half, so the engine's backward goes on while the
    collective waits (on NCCL it runs on its own stream). It never reads the input again after
    returning (it works on a copy: [Note: gloo's copies]), so the engine frees the input then: here
    the input is overwritten right after the call, and the result is still the average.

    The peer (a thread of this process) issues its half only once rank 0's call has returned (an
    event, not a sleep: no margin for a loaded machine to eat, and no time added). Had the call
    waited for the peer, it would return only after the peer gave up waiting (``PEER_WAIT_S``)."""
    returned = threading.Event()  # set by rank 0 once its call returned

    def rank_fn(rank: int, world: int) -> tuple[float, bool, bool | None]:
        pg = engine_group(dist.group.WORLD)
        out, inp = torch.empty(4), torch.ones(4 * world)
        dist.barrier(pg)
        released = returned.wait(timeout=PEER_WAIT_S) if rank == 1 else None
        t0 = time.perf_counter()
        work = reduce_scatter_avg(out, inp, pg, async_op=True)
        issued_s, done = time.perf_counter() - t0, work.is_completed()
        if rank == 0:
            returned.set()
        inp.fill_(float("nan"))
        _collectives.wait(work, "the test's reduce-scatter", pg)
        assert torch.equal(out, torch.ones(4))
        return issued_s, done, released

    (issued_s, done, _), (_, _, released) = _inproc.run_ranks(rank_fn, 2, timeout=3 * PEER_WAIT_S)
    # rank 0's call returned (and was not complete) before the peer issued its half
    assert released and not done and issued_s < PEER_WAIT_S, (issued_s, done, released)
