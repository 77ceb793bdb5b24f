"""Parameters of several dtypes in one ``fully_shard`` group (blockshard/runtime/core/_dtypes.py,
[Note: mixed dtypes]): one buffer set per dtype, trainable parameters of one dtype (FSDP2 refuses
more). In-process gloo (W = 1; W = 2 on threads)."""

from __future__ import annotations

import _inproc
import pytest
import torch
from _fsdp2_init_scenario_runs import Fp8Frozen
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import blockshard
from blockshard.runtime import ShardingError
from blockshard.runtime.core._common import ShardedState

pytestmark = [pytest.mark.timeout(60)]


class Adapted(nn.Module):
    """A frozen bf16 base layer, a frozen int64 table and a trainable fp32 adapter in one module."""

    def __init__(self, width: int = 12) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.base = nn.Linear(width, width).to(torch.bfloat16).requires_grad_(False)
            self.adapter = nn.Linear(width, width)
            self.shift = nn.Parameter(torch.arange(width, dtype=torch.int64) % 3, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x.to(torch.bfloat16)).to(x.dtype) + self.adapter(x)
        return torch.tanh(y + self.shift.to(x.dtype))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Adapted(), Adapted()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _shard(model: Net, **kw) -> Net:
    for b in model.blocks:
        blockshard.fully_shard(b, **kw)
    blockshard.fully_shard(model, **kw)
    return model


def _x() -> torch.Tensor:
    return torch.randn(5, 12, generator=torch.Generator().manual_seed(2))


def _train(model: nn.Module, steps: int = 3) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        model(_x()).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_one_buffer_set_per_dtype_names_and_state_dict(gloo_w1):
    model = _shard(Net())
    assert list(blockshard.group_layouts(model)) == [
        "blocks.0",
        "blocks.0[int64]",
        "blocks.0[bfloat16]",
        "blocks.1",
        "blocks.1[int64]",
        "blocks.1[bfloat16]",
    ]  # fmt: skip (the module's own parameters are collected first)
    layouts = blockshard.group_layouts(model)
    assert [t.name for t in layouts["blocks.0[bfloat16]"].tensors] == ["base.weight", "base.bias"]
    assert layouts["blocks.0"].dtype == "float32" and layouts["blocks.0[int64]"].dtype == "int64"
    full, plain = blockshard.full_state_dict(model), Net()
    assert full.keys() == plain.state_dict().keys()
    for k, v in plain.state_dict().items():
        assert full[k].dtype == v.dtype and torch.equal(full[k], v), k
    entries = model.state_dict()
    assert type(entries["blocks.0.base.weight"]).__name__ == "PieceTensor"  # DCP-ready, as the primary's
    back = Net()
    back.load_state_dict(full)
    for k, v in back.state_dict().items():
        assert torch.equal(v, plain.state_dict()[k]), k


def test_training_equals_the_unsharded_model_and_every_set_reshards(gloo_w1):
    plain, model = Net(), _shard(Net())
    _train(plain)
    _train(model)
    assert all(g.sharded_state is ShardedState.SHARDED for b in model.blocks for g in b._blockshard_state.buffer_sets)
    full = blockshard.full_state_dict(model)
    for k, v in plain.state_dict().items():
        assert torch.equal(full[k], v), k
    assert not torch.equal(full["blocks.0.adapter.weight"], Net().blocks[0].adapter.weight)  # the control: trained


def _w2(rank: int, world: int, mp: bool) -> dict:
    with _inproc.serial():
        model = Net()
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mp else {}
    _shard(model, **kw)
    _train(model)
    return blockshard.full_state_dict(model)


def test_two_ranks_equal_one_process_bitwise():
    plain = Net()
    with _inproc.single_thread():
        _train(plain)
    for got in _inproc.run_ranks(_w2, 2, args=(False,)):
        for k, v in plain.state_dict().items():
            assert torch.equal(got[k], v), k


def test_mixed_precision_casts_every_floating_set_and_keeps_integers(gloo_w1):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _shard(Net(), mp_policy=mp)
    seen = {}
    model.blocks[0].register_forward_pre_hook(
        lambda m, _a: seen.update({n: p.dtype for n, p in m.named_parameters()})
    )  # after the engine's hook: the gathered parameters
    model(_x()).square().mean().backward()
    assert seen == {"base.weight": torch.bfloat16, "base.bias": torch.bfloat16, "adapter.weight": torch.bfloat16,
                    "adapter.bias": torch.bfloat16, "shift": torch.int64}  # fmt: skip
    assert model.blocks[0].adapter.weight.grad.dtype == torch.float32


def test_trainable_parameters_of_two_dtypes_are_refused_as_fsdp2(gloo_w1):
    net = Net()
    net.blocks[0].base.requires_grad_(True)
    with pytest.raises(
        ShardingError, match=r"trainable parameters of several dtypes in one group: .*bfloat16.*float32"
    ):
        blockshard.fully_shard(net.blocks[0])
    model = _shard(Net())
    model.blocks[1].base.weight.requires_grad_(True)  # unfrozen after fully_shard: the next forward raises
    with pytest.raises(ShardingError, match="trainable parameters of several dtypes"):
        model(_x())


def _checkpoint_round_trip(rank: int, world: int, path: str) -> dict:
    with _inproc.serial():
        model, fresh = Net(), Net()
    _shard(model)
    _train(model)
    blockshard.save_checkpoint(model, path)
    with torch.no_grad():
        for b in fresh.blocks:  # other values everywhere, the frozen sets included
            b.base.weight.zero_()
            b.shift.zero_()
    _shard(fresh)
    blockshard.load_checkpoint(fresh, path)
    return {"saved": blockshard.full_state_dict(model), "loaded": blockshard.full_state_dict(fresh)}


def test_a_checkpoint_of_a_mixed_dtype_model_loads_every_set(tmp_path):
    for r in _inproc.run_ranks(_checkpoint_round_trip, 2, args=(str(tmp_path / "ckpt"),)):
        assert r["saved"].keys() == r["loaded"].keys()
        for k, v in r["saved"].items():
            assert torch.equal(r["loaded"][k], v), k


def test_a_frozen_float8_parameter_gathers_on_gloo_and_trains_beside_fp32(gloo_w1):
    # torch's test_mixed_dtypes_no_grad_param: gloo has no float8 ("Invalid scalar type"), so the
    # engine moves float8 buffers as their bytes; the result equals one process bitwise
    model, ref = Fp8Frozen(), Fp8Frozen()  # the spawned scenario run's model
    blockshard.fully_shard(model)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(6))
    for m in (model, ref):
        m(x).sum().backward()
        with torch.no_grad():
            m.w_fp32 -= 0.1 * m.w_fp32.grad
    full = blockshard.full_state_dict(model)
    assert torch.equal(full["w_fp32"], ref.w_fp32.detach())
    assert full["w_fp8"].dtype == torch.float8_e4m3fn
    assert torch.equal(full["w_fp8"].view(torch.uint8), ref.w_fp8.detach().view(torch.uint8))
