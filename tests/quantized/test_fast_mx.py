"""torchao ``MXTensor`` frozen weights (MXFP8 e4m3, MXFP4 e2m1) sharded by whole 1 x 32 blocks.

Three MX linears with bf16 adapters, each its own group (threaded gloo ranks, the whole batch on
every rank): logits, first-step adapter gradients and adapters after two AdamW steps equal one
process bitwise at W in {2, 4}; at W = 3 the logits stay bitwise and the gradients are within one
bf16 ulp. A unit is 33 bytes (fp8: 32 + its E8M0 scale) or 17 (fp4), so ranks hold total / W to
within a unit. Control: stock FSDP2 cannot shard an ``MXTensor`` (its dispatch has no ``split``).
"""

from __future__ import annotations

import functools

import _inproc
import _mx_runs
import pytest
import torch
from _adapters import check_equal_one_process

import blockshard
from blockshard import QuantizedWeightError

pytestmark = pytest.mark.timeout(300)

ELEMS = ["float8_e4m3fn", "float4_e2m1fn_x2"]


@functools.cache
def reference(elem: str) -> dict:
    with _inproc.single_thread():
        return _mx_runs.train(0, 0, elem)


@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_mx_weights_equal_one_process(world, elem):
    want = reference(elem)
    results = _inproc.run_ranks(_mx_runs.train, world, kwargs={"elem": elem})
    unit = 33 if elem == "float8_e4m3fn" else 17
    check_equal_one_process(results, want, world)
    for got in results:
        assert got["held"] <= got["total"] / world + 3 * unit  # three groups, each within one unit


def test_control_stock_fsdp2_cannot_shard_mx_weights():
    for res in _inproc.run_ranks(_mx_runs.stock_fsdp2, 2):
        assert "MXTensor dispatch" in res["error"]


def test_a_swizzled_scale_layout_is_refused():
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    def one_rank(rank, world):
        layer = _mx_runs.MXLoRALinear(64, 32, "float8_e4m3fn")
        w = layer.weight
        _names, ctx = w.__tensor_flatten__()
        swizzled = MXTensor.__tensor_unflatten__(
            {"qdata": w.qdata, "scale": w.scale}, {**ctx, "is_swizzled_scales": True}, w.shape, w.stride()
        )
        layer.weight = torch.nn.Parameter(swizzled, requires_grad=False)
        with pytest.raises(QuantizedWeightError, match=r"'weight' \(torchao MXTensor\): its scales are swizzled"):
            blockshard.fully_shard(layer)
        return True

    assert _inproc.run_ranks(one_rank, 1) == [True]
