"""``model.to(dtype)``, ``.double()``, ``.half()``, ``.bfloat16()`` after ``fully_shard``, as FSDP2
([Note: converting a sharded model] in blockshard/runtime/core/_module.py), on threaded gloo ranks
(W = 2, every rank the whole batch, so the averaged gradient is every rank's own exactly):
training after the conversion is bitwise equal to one process that converted the unsharded model
and to stock FSDP2 (torch's ``fully_shard``) converted the same way. Before, blockshard refused
every conversion; the control shows the conversion really changes the numbers (fp32 training
differs)."""

from __future__ import annotations

import _convert_runs
import _inproc
import pytest
import torch

import blockshard
from blockshard.runtime import ShardingError

pytestmark = pytest.mark.timeout(180)


def _one_process(*args: object) -> dict:
    with _inproc.single_thread():  # as the ranks (one intra-op thread each): the same reductions
        return _convert_runs.train_converted(0, 1, "none", *args)


def _same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, (k, got[k].dtype, want[k].dtype)
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("how", ["double", "to_float64", "bfloat16", "half"])
def test_training_after_a_conversion_equals_one_process_and_stock_fsdp2_bitwise(how):
    one = _one_process(how)
    ours = _inproc.run_ranks(_convert_runs.train_converted, 2, args=("blockshard", how))
    stock = _inproc.run_ranks(_convert_runs.train_converted, 2, args=("fsdp2", how))
    dtype = str(_convert_runs.HOW[how][1])
    for r in range(2):
        assert ours[r]["local_dtypes"] == [dtype]  # the pieces are in the new dtype
        _same(ours[r]["params"], one["params"])
        _same(ours[r]["params"], stock[r]["params"])
        assert ours[r]["losses"] == one["losses"] == stock[r]["losses"]


def test_the_conversion_changes_the_training_control():
    """fp32 training is not float64 training: the comparison above sees the dtype."""
    ours = _inproc.run_ranks(_convert_runs.train_converted, 2, args=("blockshard", "double"))
    one = _one_process("double")
    assert ours[0]["losses"] == one["losses"]
    half = _inproc.run_ranks(_convert_runs.train_converted, 2, args=("blockshard", "half"))
    assert half[0]["losses"] != ours[0]["losses"]


def test_a_set_param_dtype_stays_after_the_conversion_as_in_stock_fsdp2():
    """``mp_policy=MixedPrecisionPolicy(param_dtype=float32)``, then ``.double()``: float64 pieces,
    float32 compute, as stock FSDP2 (bitwise)."""
    ours = _inproc.run_ranks(_convert_runs.train_converted, 2, args=("blockshard", "double", True))
    stock = _inproc.run_ranks(_convert_runs.train_converted, 2, args=("fsdp2", "double", True))
    assert ours[0]["local_dtypes"] == ["torch.float64"]
    _same(ours[0]["params"], stock[0]["params"])
    assert ours[0]["losses"] == stock[0]["losses"]


def test_an_optimizer_built_before_the_conversion_raises_at_its_first_step():
    messages = _inproc.run_ranks(_convert_runs.optimizer_before_conversion, 2)
    for m in messages:
        assert "converting the model to torch.float64 replaced" in m
        assert "Fix: build the optimizer after converting the model" in m


def test_a_conversion_while_gradients_are_held_is_refused_naming_zero_grad():
    messages = _inproc.run_ranks(_convert_runs.converted_with_gradients, 2)
    for m in messages:
        assert "while its parameters hold gradients" in m and "optimizer.zero_grad()" in m
        assert m.endswith("| then: torch.float64")


def test_moving_to_another_device_is_refused(gloo_w1):
    from blockshard._tiny import OddMLP

    model = OddMLP()
    blockshard.fully_shard(model)
    with pytest.raises(ShardingError, match=r"moving a sharded module to another device .* Fix: move"):
        model.to("meta")
    assert next(model.parameters()).device.type == "cpu"
    assert model.to("cpu") is model and model.float() is model  # no change: nothing to do
