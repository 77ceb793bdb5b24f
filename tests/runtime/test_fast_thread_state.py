"""No engine state that two thread ranks share (issue 21, item 5): what one rank does inside
``ShardedModule._apply`` or ``uncounted_steps()`` never changes another rank's model, and a
group's owner plan lives on the group. Two in-process gloo ranks on threads, one of them held
inside the call while the other acts.

Controls: the refused conversion is the one a rank outside any ``_apply`` gets (rank 0's own,
after its ``_apply`` ended), and the counted step is the one an uncounted step does not give.
"""

from __future__ import annotations

import threading

import _inproc
import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(60)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.inner = nn.Linear(8, 8)
            self.head = nn.Linear(8, 2)
        self.register_buffer("scale", torch.ones(3))  # not the engine's: torch's _apply converts it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inner(x))) * self.scale[0]


def _sharded() -> _Net:
    import blockshard

    with _inproc.serial():
        model = _Net()
    blockshard.fully_shard(model.inner)
    blockshard.fully_shard(model)
    return model


def _outcome(fn) -> str:
    try:
        fn()
    except Exception as exc:  # the test asserts on the type and text
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_one_rank_inside_apply_leaves_the_other_ranks_checks_on():
    inside, done = threading.Event(), threading.Event()

    def run(rank: int, world: int) -> dict:
        model = _sharded()
        if rank == 0:

            def hold(t: torch.Tensor) -> torch.Tensor:
                if t.shape == (3,):  # the buffer: torch's _apply is running, the engine's checks are done
                    inside.set()
                    assert done.wait(30), "rank 1 never finished"
                return t

            model._apply(hold)
            return {"after": _outcome(lambda: model.to("meta"))}  # the control: outside any _apply, refused
        assert inside.wait(30), "rank 0 never entered _apply"
        try:
            return {"during": _outcome(lambda: model.to("meta")), "device": str(model.inner.weight.device)}
        finally:
            done.set()

    outs = _inproc.run_ranks(run, 2)
    assert outs[0]["after"].startswith("ShardingError: moving a sharded module to another device"), outs[0]
    assert outs[1]["during"].startswith("ShardingError: moving a sharded module to another device"), outs[1]
    assert outs[1]["device"] == "cpu"


def test_one_rank_inside_uncounted_steps_leaves_the_other_ranks_steps_counted():
    from blockshard.runtime.core._optim_guard import uncounted_steps
    from blockshard.runtime.core._state import state_of

    inside, done = threading.Event(), threading.Event()

    def run(rank: int, world: int) -> dict:
        model = _sharded()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with torch.no_grad():
            model(torch.ones(2, 8))  # the first forward makes the root context and its tally
        tally = state_of(model).buffers.tally
        assert tally is not None
        if rank == 0:
            with uncounted_steps():
                opt.step()
                inside.set()
                assert done.wait(30), "rank 1 never finished"
            uncounted = tally.optimizer_stepped
            opt.step()  # the control: counted
            return {"uncounted": uncounted, "counted": tally.optimizer_stepped}
        assert inside.wait(30), "rank 0 never entered uncounted_steps()"
        try:
            opt.step()
            return {"counted": tally.optimizer_stepped}
        finally:
            done.set()

    outs = _inproc.run_ranks(run, 2)
    assert outs[0] == {"uncounted": False, "counted": True}
    assert outs[1] == {"counted": True}


def test_a_groups_owner_plan_lives_on_the_group():
    import blockshard.runtime.core._owners as owners
    from blockshard.runtime.core._state import state_of

    def run(rank: int, world: int) -> dict:
        import blockshard

        with _inproc.serial():
            model = nn.Sequential(nn.Linear(24, 24), nn.Linear(24, 24))
        blockshard.fully_shard(model, semantics="muon", policy="owner")
        plan = blockshard.runtime.owner_plan(model)
        entry = state_of(model).buffers.owner_computed
        return {"names": sorted(plan), "on_group": sorted(entry.compute) if entry else []}

    outs = _inproc.run_ranks(run, 2)
    assert outs[0]["names"] and outs[0]["on_group"] == outs[0]["names"], outs[0]
    assert not hasattr(owners, "_REGISTRY")  # no process-wide registry beside the groups
