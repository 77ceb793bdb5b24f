"""``torch.compile`` on sharded layers: the engine's forward hooks run eagerly around the compiled
graph (``runtime/core/_common.eager``, as FSDP2's ``_dynamo_disable``), so a compiled layer's graph is
its forward alone, compiles with ``fullgraph=True``, is not recompiled from step to step, and
trains as the eager model does. FSDP2's graphs on the same model are the reference; the control
is the engine with its hooks traced (what it did before): an engine op lands in the graph and
``fullgraph=True`` fails. In-process gloo, W = 1 (slow tier: compiling takes about 10 s)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

import blockshard
from blockshard.runtime.core import _state

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(120)]  # in process; compiling takes ~10 s


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


def _model() -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(Block(), Block(), Block())


def _sharded(shard) -> nn.Sequential:
    model = _model()
    for block in model:
        shard(block)
    shard(model)
    return model


class Graphs:
    """A dynamo backend that records each graph's ops and runs it as traced."""

    def __init__(self) -> None:
        self.ops: list[list[str]] = []

    def __call__(self, gm: torch.fx.GraphModule, _inputs) -> object:
        self.ops.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward


def _compiled_steps(model: nn.Sequential, backend, steps: int, fullgraph: bool = True) -> list[torch.Tensor]:
    torch._dynamo.reset()
    for block in model:
        block.compile(backend=backend, fullgraph=fullgraph)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def test_a_compiled_layer_graph_is_its_forward_alone_as_under_fsdp2(gloo_w1):
    ours, theirs, first_step = Graphs(), Graphs(), Graphs()
    _compiled_steps(_sharded(blockshard.fully_shard), first_step, steps=1)
    _compiled_steps(_sharded(blockshard.fully_shard), ours, steps=3)
    _compiled_steps(_sharded(fsdp2_fully_shard), theirs, steps=3)
    assert ours.ops == first_step.ops  # nothing recompiled at steps 2 and 3
    assert ours.ops == theirs.ops and len(ours.ops) >= 1
    assert all(op.endswith(("linear>", "add>")) or "relu of" in op for g in ours.ops for op in g)


def test_compiled_training_equals_eager_one_process(gloo_w1):
    compiled = _compiled_steps(_sharded(blockshard.fully_shard), "aot_eager", steps=3)
    eager = []
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        eager.append(loss.detach())
    assert torch.equal(torch.stack(compiled), torch.stack(eager))  # bitwise: aot_eager runs the same kernels


def test_control_traced_engine_hooks_enter_the_graph(gloo_w1, monkeypatch):
    monkeypatch.setattr(_state, "eager", lambda hook: hook)  # the hooks as they were: traced by dynamo
    with pytest.raises(Exception, match=r"_current_graph_task_id|non-Tensor"):
        _compiled_steps(_sharded(blockshard.fully_shard), Graphs(), steps=1, fullgraph=True)
    graphs = Graphs()
    _compiled_steps(_sharded(blockshard.fully_shard), graphs, steps=1, fullgraph=False)
    assert any("resize_storage_bytes_" in op for g in graphs.ops for op in g)
