"""``fully_shard([norm, head])``: one group over several modules, FSDP2's semantics
(blockshard/runtime/core/_list_groups.py, [Note: a list of modules]). In-process gloo (W = 1; W = 2 on threads)."""

from __future__ import annotations

import _inproc
import pytest
import torch
from torch import nn

import blockshard
from blockshard.runtime import ShardedModule, ShardingError
from blockshard.runtime.core._common import ShardedState

pytestmark = [pytest.mark.timeout(60)]


class Net(nn.Module):
    """Layers, then a norm and a head (the usual list group), the head's weight not tied."""

    def __init__(self, n: int = 2, width: int = 8) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.body = nn.Module()
            self.body.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(n)])
            self.body.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, 3)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.body.layers:
            x = torch.tanh(layer(x))
        return self.body.norm(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _shard(model: Net, root: bool = True) -> Net:
    for layer in model.body.layers:
        blockshard.fully_shard(layer)
    out = blockshard.fully_shard([model.body.norm, model.head])
    assert out == [model.body.norm, model.head]  # the argument comes back, as FSDP2's
    if root:
        blockshard.fully_shard(model)
    return model


def _state(m: nn.Module) -> ShardedState:
    return m._blockshard_state.buffers.sharded_state


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _gathers(model: nn.Module, fn) -> list[str | None]:
    with _inproc.CollectiveLog() as log:
        log.label_groups(model)
        fn()
    return [label for kind, label in log.events if kind == "all_gather"]


def test_one_group_over_the_listed_modules_with_names_as_the_model_has_them(gloo_w1):
    model = _shard(Net())
    norm, head = model.body.norm, model.head
    assert isinstance(norm, ShardedModule) and isinstance(head, ShardedModule)
    assert norm._blockshard_state is head._blockshard_state  # one state, on each module
    layouts = blockshard.group_layouts(model)
    assert list(layouts) == ["body.layers.0", "body.layers.1", "body.norm+head"]  # the root has no parameters
    names = [t.name for t in layouts["body.norm+head"].tensors]
    assert sorted(names) == ["body.norm.bias", "body.norm.weight", "head.bias", "head.weight"]
    full = blockshard.full_state_dict(model)
    plain = Net()
    assert full.keys() == plain.state_dict().keys()
    for k, v in plain.state_dict().items():
        assert torch.equal(full[k], v), k


def test_gathered_before_the_first_and_resharded_after_the_last(gloo_w1):
    model = _shard(Net())
    norm, head = model.body.norm, model.head
    seen = []
    head.register_forward_pre_hook(lambda *_: seen.append(("head in", _state(head))))
    norm.register_forward_hook(lambda *_: seen.append(("norm out", _state(norm))))
    loss = model(_x()).square().mean()
    assert seen == [("norm out", ShardedState.UNSHARDED), ("head in", ShardedState.UNSHARDED)]
    assert _state(norm) is ShardedState.SHARDED  # after the last of them (not the root: resharded)
    loss.backward()
    assert all(_state(m) is ShardedState.SHARDED for m in [*model.body.layers, norm, model])
    # per step: the list's group gathered once in forward and once in backward, as each layer
    gathers = _gathers(model, lambda: model(_x()).square().mean().backward())
    assert gathers.count("body.layers.0") == 2 and gathers.count("body.layers.1") == 2
    assert gathers.count("body.norm+head") == 2 and len(gathers) == 6


def test_equal_to_the_unsharded_model_over_steps(gloo_w1):
    plain, model = Net(), _shard(Net())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, model)]
    for _ in range(3):
        for m, opt in zip((plain, model), opts, strict=True):
            m(_x()).square().mean().backward()
            opt.step()
            opt.zero_grad()
    full = blockshard.full_state_dict(model)
    for k, v in plain.state_dict().items():
        assert torch.equal(full[k], v), k
    assert torch.equal(model(_x()), plain(_x()))
    assert not torch.equal(full["head.weight"], Net().head.weight)  # the control: training moved it


def test_chunked_loss_head_called_after_the_models_forward(gloo_w1):
    """FSDP2's motivating case: forward runs the norm only; the head runs per chunk afterwards."""
    plain, model = Net(), _shard(Net())
    for m in (plain, model):
        feats = m.features(_x()) if m is plain else _features(m)
        loss = sum(m.head(chunk).square().mean() for chunk in feats.split(2))
        loss.backward()
    grads = {n: p.grad for n, p in plain.named_parameters()}
    # the sharded model's gradients are the plain ones (W = 1: the piece is the whole tensor)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad.reshape(-1), grads[n].reshape(-1)), n
    assert all(_state(m) is ShardedState.SHARDED for m in [*model.body.layers, model.head])


def _features(model: Net) -> torch.Tensor:
    # the root's forward here is features(): call it through the root's hooks
    blockshard.register_forward_method(model, "features")
    return model.features(_x())


def test_a_list_without_a_sharded_parent_names_its_tensors_at_the_first_inspection(gloo_w1):
    model = _shard(Net(), root=False)
    state = model.head._blockshard_state
    assert {sp.fqn for sp in state.buffers.params} == {"0.weight", "0.bias", "1.weight", "1.bias"}
    full = blockshard.full_state_dict(model)
    assert {sp.fqn for sp in state.buffers.params} == {"body.norm.weight", "body.norm.bias", "head.weight", "head.bias"}
    assert torch.equal(full["head.weight"], Net().head.weight)
    plain = Net()
    assert torch.equal(model(_x()), plain(_x()))


def test_meta_init_of_a_list_group_equals_unsharded_init(gloo_w1):
    with torch.device("meta"):
        model = Net()
    _shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(5)
    blockshard.init_parameters(model)
    plain = Net()
    torch.manual_seed(5)
    for m in plain.modules():
        if m._parameters and hasattr(m, "reset_parameters"):
            m.reset_parameters()
    full = blockshard.full_state_dict(model)
    for k, v in plain.state_dict().items():
        assert torch.equal(full[k], v), k
    assert torch.equal(model(_x()), plain(_x()))


def test_misuse_of_a_list(gloo_w1):
    with pytest.raises(ShardingError, match="non-empty list"):
        blockshard.fully_shard([])
    with pytest.raises(ShardingError, match="item 1 of the list is a str"):
        blockshard.fully_shard([nn.Linear(2, 2), "x"])
    net = Net()
    blockshard.fully_shard(net.head)
    with pytest.raises(ShardingError, match="Linear is already sharded"):
        blockshard.fully_shard([net.body.norm, net.head])
    with pytest.raises(ShardingError, match="not supported in a list's group"):
        blockshard.fully_shard([nn.Linear(64, 64), nn.Linear(64, 64)], semantics="muon", policy="owner")


def _w2_grads(rank: int, world: int) -> dict:
    with _inproc.serial():
        model = Net()
    _shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(_x()).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return blockshard.full_state_dict(model)


def test_two_ranks_equal_one_process_bitwise():
    plain = Net()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    with _inproc.single_thread():
        for _ in range(2):
            plain(_x()).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for got in _inproc.run_ranks(_w2_grads, 2):
        for k, v in plain.state_dict().items():
            assert torch.equal(got[k], v), k
