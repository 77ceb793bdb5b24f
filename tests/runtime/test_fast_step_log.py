"""The engine's collective counters and the step log ([Note: traffic] in runtime/core/_traffic.py).

Threaded gloo ranks, two training steps each. What every collective moved (the bytes of the
tensors the engine handed to gloo, counted where they are issued) must equal what the planner
predicts from the shapes alone (``plan_model``: the layout's padded size times the dtype the policy
moves; the quantized segments of ``plan_model(..., quantized_gather=True)``), per group and kind:
float groups at W = 2, 3 and 4, mixed precision (bf16 gathered, fp32 reduced), FP8-block weights
gathered quantized (frozen bitsandbytes 4-bit weights: tests/quantized/test_fast_quantized_traffic.py).
The counts are FSDP2's: a layer's group
gathers twice per step (forward, and again for backward after resharding), the root once, and each
reduces once. Then the log lines (``set_step_log``, ``BLOCKSHARD_LOG``), a mismatch raising under
``BLOCKSHARD_STRICT=1`` and warning otherwise, and the refusals of bad values.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import warnings

import _inproc
import pytest
import torch
from torch import nn

import blockshard
from blockshard.planner import plan_model
from blockshard.runtime import CollectiveCount, StepLogError, TrafficMismatchError, collective_counts, set_step_log
from blockshard.runtime.core._traffic import Traffic
from blockshard.semantics import TensorSpec

pytestmark = pytest.mark.timeout(60)

STEPS = 2


class Net(nn.Module):
    def __init__(self, width: int = 13, hidden: int = 29) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)) for _ in range(2)
            )
            self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _specs(net: nn.Module) -> list[TensorSpec]:
    out = []
    for name, p in net.named_parameters():
        group = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else None
        out.append(TensorSpec(name=name, shape=tuple(p.shape), dtype=p.dtype, group=group))
    return out


def _train(rank: int, world: int, kw: dict, width: int, hidden: int) -> list[CollectiveCount]:
    with _inproc.serial():
        model = Net(width, hidden)
    for b in model.blocks:
        blockshard.fully_shard(b, **kw)
    blockshard.fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(STEPS):
        model(torch.ones(3, width)).sum().backward()
        opt.step()
        opt.zero_grad()
    return collective_counts(model)


def _by(rows: list[CollectiveCount], group: str, kind: str) -> list[CollectiveCount]:
    return [r for r in rows if r.group == group and r.kind == kind]


def _gathers_per_step(group: str) -> int:
    return 1 if group == "" else 2  # FSDP2's: the root stays gathered from forward to backward


@pytest.mark.parametrize(
    "world", [2, pytest.param(3, marks=pytest.mark.heavy), pytest.param(4, marks=pytest.mark.heavy)]
)
def test_float_groups_move_what_the_plan_predicts(world):
    kw = {"semantics": {"*weight": "matrix"}, "policy": "owner"}
    ranks = _inproc.run_ranks(_train, world, args=(kw, 13, 29))
    plan = plan_model(_specs(Net()), world, semantics=kw["semantics"], policy="owner")
    for rows in ranks:
        assert rows and all(r.agrees for r in rows), rows
        assert {r.group for r in rows} == {g.name for g in plan.groups}
        for layout in plan.groups:
            g = layout.name
            (ag,) = _by(rows, g, "all-gather")
            (rs,) = _by(rows, g, "reduce-scatter")
            assert (ag.wire, ag.dtype, rs.dtype) == ("float", "float32", "float32")
            assert ag.calls == STEPS * _gathers_per_step(g) and rs.calls == STEPS, (g, ag, rs)
            assert ag.bytes == ag.calls * layout.padded_numel * 4, g  # the planner's padded segment, W * S
            assert rs.bytes == rs.calls * layout.padded_numel * 4, g
            assert not _by(rows, g, "all-reduce")  # no replicate axis


def test_mixed_precision_gathers_bf16_and_reduces_fp32():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = {"mp_policy": mp}
    ranks = _inproc.run_ranks(_train, 2, args=(kw, 13, 29))
    plan = plan_model(_specs(Net()), 2)
    for rows in ranks:
        assert all(r.agrees for r in rows), rows
        for layout in plan.groups:
            (ag,) = _by(rows, layout.name, "all-gather")
            (rs,) = _by(rows, layout.name, "reduce-scatter")
            assert (ag.dtype, rs.dtype) == ("bfloat16", "float32")
            assert ag.bytes == ag.calls * layout.padded_numel * 2 and rs.bytes == rs.calls * layout.padded_numel * 4


def test_fp8_block_weights_are_gathered_quantized_as_planned():
    kw = {"semantics": {"*0.weight": "fp8_block:128", "*2.weight": "fp8_block:128"}, "quantized_gather": True}
    ranks = _inproc.run_ranks(_train, 2, args=(kw, 128, 256))
    plan = plan_model(_specs(Net(128, 256)), 2, semantics=kw["semantics"], quantized_gather=True)
    assert plan.quantized_gather_groups
    for rows in ranks:
        assert all(r.agrees for r in rows), rows
        for q in plan.quantized_gather_groups:
            got = [r for r in rows if r.wire == "quantized payload" and r.group == q.group]
            assert len(got) == 1, (q.group, rows)
            (ag,) = got
            assert ag.calls == STEPS * q.gathers_per_step and ag.dtype == "uint8"
            assert ag.bytes == ag.calls * q.gathered_bytes  # the planner's W * S_q
        # the quantized weights' masters never travel as floats
        assert not [r for r in rows if r.kind == "all-gather" and r.wire == "float" and "quantized" in r.buffer_set]


def _logged(rank: int, world: int) -> int:
    with _inproc.serial():
        model = Net()
    blockshard.fully_shard(model)
    for _ in range(STEPS):
        model(torch.ones(3, 13)).sum().backward()
    return 0


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_step_log_writes_the_first_steps():
    log, seen = logging.getLogger("blockshard"), _Lines()
    level = log.level
    log.addHandler(seen)
    log.setLevel(logging.INFO)
    set_step_log(1)
    try:
        _inproc.run_ranks(_logged, 2)
    finally:
        set_step_log(0)
        log.removeHandler(seen)
        log.setLevel(level)
    lines = seen.lines
    assert len([x for x in lines if x.startswith("step 1: all-gather of")]) == 2, lines  # one per rank
    assert len([x for x in lines if x.startswith("step 1: reduce-scatter of")]) == 2, lines
    summaries = [x for x in lines if x.startswith("step 1 of the model rooted at")]
    assert len(summaries) == 2 and all(x.endswith("as planned") for x in summaries), summaries
    assert not [x for x in lines if x.startswith("step 2")]  # only the first step


@pytest.mark.heavy  # a subprocess importing torch: seconds
def test_blockshard_log_env_prints_to_stderr_in_a_script():
    code = textwrap.dedent(
        """
        import os, torch, torch.distributed as dist, blockshard
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
        dist.init_process_group("gloo", rank=0, world_size=1)
        m = torch.nn.Linear(4, 4)
        blockshard.fully_shard(m)
        for _ in range(3):
            m(torch.ones(2, 4)).sum().backward()
        dist.destroy_process_group()
        """
    )
    env = {**os.environ, "BLOCKSHARD_LOG": "info", "BLOCKSHARD_LOG_STEPS": "2", "PORT": str(_free_port())}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [x for x in out.stderr.splitlines() if x.startswith("[blockshard rank 0]")]
    assert any("step 2 of the model rooted at" in x for x in lines), out.stderr
    assert not any("step 3" in x for x in lines), lines


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_mismatch_raises_under_strict_and_warns_once_otherwise(monkeypatch):
    monkeypatch.setenv("BLOCKSHARD_STRICT", "1")
    with pytest.raises(TrafficMismatchError, match=r"moved 96 bytes .* where its plan predicts 64"):
        Traffic().record("'g'", 0, 96, 64, torch.float32, "float", 1)
    monkeypatch.delenv("BLOCKSHARD_STRICT")
    t = Traffic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.record("'g'", 0, 96, 64, torch.float32, "float", 1)
        t.record("'g'", 0, 96, 64, torch.float32, "float", 1)
    assert len(caught) == 1 and "plan predicts 64" in str(caught[0].message)
    (row,) = t.counts("g", "g")
    assert (row.calls, row.bytes, row.predicted_bytes, row.agrees) == (2, 192, 128, False)
    t.record("'g'", 1, 64, 64, torch.float32, "float", 1)  # the control: as planned, nothing said
    assert len(t.counts("g", "g")) == 2


def test_calls_checked_together_settle_against_their_round(monkeypatch):
    """[Note: traffic] ``predicted=None`` (DeepSpeed's gradient buckets): nothing is checked per
    call; :meth:`Traffic.settle` checks the round's sum, and a call of another kind or dtype in the
    round is a mismatch (the plan predicts none of it)."""
    monkeypatch.setenv("BLOCKSHARD_STRICT", "1")
    t = Traffic()
    t.record("'b'", 2, 40, None, torch.float32, "float", 1)
    t.record("'b'", 2, 24, None, torch.float32, "float", 1)
    t.settle("'round'", 2, 64, torch.float32)  # the control: 40 + 24 = 64, as planned
    (row,) = t.counts("g", "g")
    assert (row.kind, row.calls, row.bytes, row.predicted_bytes, row.agrees) == ("all-reduce", 2, 64, 64, True)
    assert t.take_step() == ({"all-reduce": 64}, {"all-reduce": 64})
    t.record("'b'", 2, 40, None, torch.float32, "float", 2)
    with pytest.raises(TrafficMismatchError, match=r"all-reduce of 'round' moved 40 bytes .* predicts 64"):
        t.settle("'round'", 2, 64, torch.float32)
    t.record("'b'", 4, 64, None, torch.bfloat16, "float", 3)
    with pytest.raises(TrafficMismatchError, match=r"reduce of 'round' moved 64 bytes \(bfloat16"):
        t.settle("'round'", 2, 0, torch.float32)
    assert t.unsettled == {}


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_set_step_log_refuses_what_is_not_a_count(bad):
    with pytest.raises(StepLogError, match=r"set_step_log\(steps=.*\): steps must be an int >= 0"):
        set_step_log(bad)


def test_bad_environment_values_are_named(monkeypatch):
    from blockshard.runtime.core import _traffic

    monkeypatch.setattr(_traffic, "_state", _traffic._StepLog())
    monkeypatch.setenv("BLOCKSHARD_LOG", "loud")
    with pytest.raises(StepLogError, match="BLOCKSHARD_LOG='loud' must be 'info'"):
        _traffic.step_log_steps()
    monkeypatch.setattr(_traffic, "_state", _traffic._StepLog())
    monkeypatch.setenv("BLOCKSHARD_LOG", "info")
    monkeypatch.setenv("BLOCKSHARD_LOG_STEPS", "two")
    with pytest.raises(StepLogError, match="BLOCKSHARD_LOG_STEPS='two' must be a whole number"):
        _traffic.step_log_steps()


def _owner(rank: int, world: int) -> list[CollectiveCount]:
    from blockshard.optim import OwnerComputeOptimizer, muon_param_groups

    with _inproc.serial():
        model = Net()
    kw = {"semantics": {"*weight": "matrix"}, "policy": "owner"}
    for b in model.blocks:
        blockshard.fully_shard(b, **kw)
    blockshard.fully_shard(model, **kw)
    muon_group, rest = muon_param_groups(model)
    muon = OwnerComputeOptimizer(lambda g: torch.optim.Muon(g, lr=0.02), [muon_group])
    adamw = torch.optim.AdamW([rest], lr=1e-3)
    for _ in range(STEPS):
        model(torch.ones(3, 13)).sum().backward()
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
    return muon.collective_counts()


def test_owner_compute_all_to_alls_are_counted():
    """At W = 3 the matrices are cut and computed at their owners: one all_to_all of values when the
    optimizer is built (``resync_params``), then per step one of gradients to the owners and one of
    values back, each as the exchange plan sends (the elements of cut units a rank holds but does
    not own, so some rank sends)."""
    ranks = _inproc.run_ranks(_owner, 3)
    for rows in ranks:
        (row,) = rows
        assert (row.kind, row.wire, row.dtype, row.calls) == ("all-to-all", "float", "float32", 1 + 2 * STEPS)
        assert row.agrees, row
    assert sum(rows[0].bytes for rows in ranks) > 0


def test_a_quantized_gather_that_sends_floats_is_a_mismatch(monkeypatch):
    """A buffer set planned to gather quantized payloads that gathers floats moves bytes its plan
    does not predict, whatever their number."""
    monkeypatch.setenv("BLOCKSHARD_STRICT", "1")
    with pytest.raises(TrafficMismatchError, match=r"predicts none as float \(it gathers quantized payload\)"):
        Traffic().record("'g'", 0, 64, 64, torch.float32, "float", 1, "quantized payload")
    Traffic().record("'g'", 0, 64, 64, torch.uint8, "quantized payload", 1, "quantized payload")  # the control


def _engage(rank: int, world: int) -> None:
    from blockshard.runtime._report._engaged import log_engaged

    with _inproc.serial():
        model = Net()
    blockshard.fully_shard(model)
    log_engaged(model, "a test", engine="ragged", semantics="elementwise", policy="auto")


def test_the_engage_line_and_report_come_once_from_rank_0():
    log, seen = logging.getLogger("blockshard"), _Lines()
    level = log.level
    log.addHandler(seen)
    log.setLevel(logging.INFO)
    try:
        set_step_log(0)
        _inproc.run_ranks(_engage, 2)  # off: nothing said, no report built
        assert seen.lines == []
        set_step_log(1)
        _inproc.run_ranks(_engage, 2)
    finally:
        set_step_log(0)
        log.removeHandler(seen)
        log.setLevel(level)
    engaged = [x for x in seen.lines if x.startswith("blockshard engaged (a test)")]
    assert engaged == [
        "blockshard engaged (a test): engine ragged, semantics elementwise, policy auto, 1 group over 2 ranks"
    ]
    assert len([x for x in seen.lines if x.startswith("blockshard report at the end of a test:")]) == 1
