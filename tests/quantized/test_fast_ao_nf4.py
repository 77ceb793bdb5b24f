"""torchao ``NF4Tensor`` frozen weights sharded by whole 16384-value super-blocks (threaded gloo ranks).

Three NF4 linears (2, 3 and 6 super-blocks) with LoRA-style bf16 adapters, each its own group: with
the whole batch on every rank, logits, first-step adapter gradients and adapters after two AdamW
steps equal one process bitwise at W in {2, 4}; at W = 3 the logits stay bitwise and the gradients
are within one bf16 ulp (rtol 2**-7; 0.0057 measured): the average of three identical bf16
gradients rounds differently from one process.
Control: stock FSDP2 with torchao's own hooks (dim 0 only, whole super-blocks per rank) fails on
these shapes at W = 2, 3 and 4.
"""

from __future__ import annotations

import functools

import _ao_runs
import _inproc
import pytest
from _adapters import check_equal_one_process

pytestmark = pytest.mark.timeout(300)


@functools.cache
def reference() -> dict:
    with _inproc.single_thread():
        return _ao_runs.train(0, 0)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_nf4tensor_weights_equal_one_process(world):
    want = reference()
    results = _inproc.run_ranks(_ao_runs.train, world)
    check_equal_one_process(results, want, world)  # payload and scalers: one rank each


@pytest.mark.parametrize("world", [2, 3, 4])
def test_control_stock_fsdp2_with_torchaos_hooks_fails(world):
    for res in _inproc.run_ranks(_ao_runs.train, world, kwargs={"stock_fsdp2": True}):
        assert res["error"], "stock FSDP2 sharded these NF4 shapes: the control no longer shows its limit"
