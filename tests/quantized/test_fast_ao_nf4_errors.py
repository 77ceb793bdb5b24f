"""Bad torchao NF4 input: a QuantizedWeightError naming the tensor and the fix."""

from __future__ import annotations

import _ao_runs
import pytest
import torch

import blockshard
from blockshard import QuantizedWeightError

pytestmark = pytest.mark.usefixtures("gloo_w1")


def test_scalers_that_do_not_fit():
    layer = _ao_runs.NF4LoRALinear(256, 128)
    w = layer.weight
    w.quantization_factor = torch.cat([w.quantization_factor, w.quantization_factor])
    with pytest.raises(
        QuantizedWeightError,
        match=r"'weight' \(torchao NF4Tensor\): its nested scalers do not fit: 32768 values need 16384 payload bytes, "
        r"512 quantized scalers and 2 quantization factors, it has 16384, 512 and 4.*to_nf4",
    ):
        blockshard.fully_shard(layer)


def test_a_trainable_nf4_weight():
    layer = _ao_runs.NF4LoRALinear(256, 128)
    layer.weight.requires_grad_(True)
    with pytest.raises(QuantizedWeightError, match=r"'weight'.*requires grad.*requires_grad_\(False\)"):
        blockshard.fully_shard(layer)


def test_one_layer_at_w1_equals_unsharded():
    torch.manual_seed(0)
    layer = _ao_runs.NF4LoRALinear(256, 128)
    torch.manual_seed(0)
    plain = _ao_runs.NF4LoRALinear(256, 128)
    blockshard.fully_shard(layer)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert torch.equal(layer(x), plain(x))
    layer.reshard()  # the root keeps its gathered weights after forward (FSDP2's default)
    assert layer.weight.dtype == torch.uint8 and layer.weight.numel() == 16384  # the payload piece (W = 1: all)
