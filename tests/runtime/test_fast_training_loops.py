"""Real training loops on the engine in-process (W = 1 on a real gloo group): the same scenarios
as test_training_loops.py, bitwise against the unsharded model, plus the errors for what the
engine cannot do right (a replaced parameter, converting a sharded model)."""

from __future__ import annotations

import _inproc
import _loops
import pytest
import torch
from torch import nn

import blockshard
from blockshard.runtime import ShardingError

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("gloo_w1")]

# LoRA (peft, ~20 s to import) runs in the slow tier only: test_training_loops.py
CASES = ["freeze_after_sharding", "requires_grad_changes", "frozen_under_no_grad", "dataclass_activations"]


@pytest.mark.parametrize("name", CASES)
def test_training_loop_equals_the_unsharded_model_bitwise(name):
    with _inproc.single_thread():
        got = _loops.run(0, 1, name, {}, True)["params"]
        want = _loops.run(0, 1, name, {}, False)["params"]
    assert got.keys() == want.keys()
    bad = {n: (got[n] - want[n]).abs().max().item() for n in want if not torch.equal(got[n], want[n])}
    assert not bad


def test_bf16_micro_batches_accumulate_in_fp32():
    with _inproc.single_thread():
        got = _loops.run(0, 1, "bf16_accumulation", {"micro": 2}, True)["params"]
        want = _loops.run(0, 1, "bf16_accumulation", {"micro": 2}, False)["params"]
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_control_freezing_after_sharding_is_not_ignored():
    """Control: the frozen run differs from a run that trains everything."""
    with _inproc.single_thread():
        frozen = _loops.run(0, 1, "freeze_after_sharding", {}, True)["params"]
        model = _loops._mlp(1)
        trained = _loops._train_mlp(model, 1)["params"]
    assert not torch.equal(frozen["blocks.1.0.weight"], trained["blocks.1.0.weight"])


def _sharded_mlp() -> nn.Module:
    with _inproc.serial():
        return _loops._mlp(1)


def test_a_parameter_replaced_after_sharding_raises_naming_it():
    model = _sharded_mlp()
    model.blocks[2][0].weight = nn.Parameter(torch.zeros(7, 29))
    with pytest.raises(
        ShardingError, match=r"parameter '0\.weight' of group 'Sequential' was replaced after fully_shard"
    ):
        model(torch.ones(2, 13))


@pytest.mark.parametrize(
    ("convert", "dtype"),
    [
        (lambda m: m.double(), torch.float64),
        (lambda m: m.to(torch.bfloat16), torch.bfloat16),
        (lambda m: m.half(), torch.float16),
    ],
)
def test_converting_a_sharded_model_converts_the_engine_s_pieces(convert, dtype):
    """As FSDP2 ([Note: converting a sharded model]); training after it: tests/runtime/test_fast_convert.py."""
    model = _sharded_mlp()
    before = list(model.parameters())
    assert convert(model) is model
    after = list(model.parameters())
    assert all(p.dtype == dtype for p in after)
    assert all(a is not b for a, b in zip(before, after, strict=True))  # new pieces over the converted buffers
    assert all(torch.equal(a.detach().to(dtype), b.detach()) for a, b in zip(before, after, strict=True))


def test_a_conversion_that_changes_nothing_is_allowed():
    model = _sharded_mlp()
    before = list(model.parameters())
    assert model.to("cpu") is model and model.float() is model
    assert all(a is b for a, b in zip(before, model.parameters(), strict=True))  # still the engine's views


def _empty_pieces_step(rank: int, world: int) -> dict:
    with _inproc.serial():
        model = _loops.OddMLP()
    blockshard.fully_shard(model, semantics="matrix")
    params = [p for p in model.parameters() if p.requires_grad]
    empty = sum(p.numel() == 0 for p in params)
    opt = torch.optim.AdamW(params, lr=1e-3)
    ((model(torch.ones(2, 13)) - 1) ** 2).mean().backward()
    opt.step()
    return {"params": len(params), "empty": empty, "nonempty_filter": sum(p.numel() > 0 for p in params)}


def test_empty_pieces_still_give_every_rank_an_optimizer():
    """The recipe that works on every rank: all parameters that require grad, empty pieces included
    (whole matrices leave a rank with (0,) pieces; torch optimizers accept them and step)."""
    out = _inproc.run_ranks(_empty_pieces_step, 2)
    assert out[0]["params"] == out[1]["params"] == len(list(_loops.OddMLP().parameters()))
    assert any(o["empty"] > 0 for o in out)  # some rank really holds empty pieces
    assert out[0]["nonempty_filter"] != out[1]["nonempty_filter"]  # a numel filter differs per rank
