"""Bad quantized input: each a QuantizedWeightError (a ValueError) naming the tensor and the fix."""

from __future__ import annotations

import _qlora
import pytest
import torch
from torch import nn

import blockshard
from blockshard import QuantizedWeightError

pytestmark = pytest.mark.usefixtures("gloo_w1")


class Block(nn.Module):
    def __init__(self, rows: int = 64, cols: int = 128, **quant) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(cols, rows, bias=False)
        self.norm = nn.LayerNorm(cols)
        _qlora.quantize_linears(self, names=("proj",), **quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def test_groups_that_do_not_divide_the_shape():
    block = Block(rows=7, cols=30)  # 210 values: 3.28 blocks of 64
    with pytest.raises(
        QuantizedWeightError, match=r"'proj\.weight'.*210 values \(shape \(7, 30\)\).*multiple of the blocksize 64"
    ):
        blockshard.fully_shard(block)


def test_a_nested_block_that_does_not_fit():
    block = Block(compress_statistics=True)
    qs = block.proj.weight.quant_state
    qs.state2.absmax = torch.cat([qs.state2.absmax, qs.state2.absmax])  # 2 nested absmax for 128 blocks of 256
    with pytest.raises(
        QuantizedWeightError,
        match=r"'proj\.weight'.*nested statistics do not fit: 128 .*need 1 state2 absmax, it has 2",
    ):
        blockshard.fully_shard(block)


def test_mixed_quant_states():
    block = Block(quant_type="nf4")
    block.proj.weight.quant_state.quant_type = "fp4"
    with pytest.raises(
        QuantizedWeightError,
        match=r"'proj\.weight'.*mixed quant states.*quant_type='nf4'.*quant_type='fp4'.*re-quantize",
    ):
        blockshard.fully_shard(block)


def test_a_quant_state_of_another_tensor():
    block, other = Block(), Block(rows=32)
    block.proj.weight.quant_state = other.proj.weight.quant_state
    with pytest.raises(
        QuantizedWeightError,
        match=r"'proj\.weight'.*payload has 4096 bytes.*need 2048 bytes and 64 absmax.*belongs to another tensor",
    ):
        blockshard.fully_shard(block)


def test_a_weight_not_quantized_yet():
    import bitsandbytes as bnb

    block = Block()
    w = torch.randn(64, 128)
    block.proj.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")  # not moved: not quantized
    with pytest.raises(QuantizedWeightError, match=r"'proj\.weight'.*not quantized yet.*model\.to\('cpu'\)"):
        blockshard.fully_shard(block)


def test_a_trainable_4bit_weight():
    block = Block(quant_storage=torch.bfloat16)  # a uint8 payload cannot require grad at all
    block.proj.weight.requires_grad_(True)
    with pytest.raises(QuantizedWeightError, match=r"'proj\.weight'.*requires grad.*requires_grad_\(False\)"):
        blockshard.fully_shard(block)


def test_errors_are_value_errors():
    assert issubclass(QuantizedWeightError, ValueError)


def test_a_block_of_one_linear_trains_at_w1():
    """The layout-free case: a group whose only parameters are quantized (and the norm) at W = 1."""
    block, plain = Block(), Block()
    blockshard.fully_shard(block.proj)  # a Linear4bit alone: no float parameters in its group
    blockshard.fully_shard(block)
    x = torch.randn(3, 128)
    assert torch.equal(block(x), plain(x))
    assert type(block.proj.weight) is nn.Parameter and block.proj.weight.dtype == torch.uint8


def test_a_quantized_weight_left_replicated_is_said_and_refused_under_strict(monkeypatch, recwarn):
    """ignored_params keeps a 4-bit weight whole on every rank: a warning naming it (no silent
    replication), an error under BLOCKSHARD_STRICT=1; the control, nothing ignored, says nothing."""
    block = Block()
    with pytest.warns(UserWarning, match=r"quantized weight 'proj\.weight' stay whole on every rank"):
        blockshard.fully_shard(block, ignored_params={block.proj.weight})
    monkeypatch.setenv("BLOCKSHARD_STRICT", "1")
    block = Block()
    with pytest.raises(QuantizedWeightError, match=r"'proj\.weight' stay whole.*BLOCKSHARD_STRICT=1"):
        blockshard.fully_shard(block, ignored_params={block.proj.weight})
    recwarn.clear()
    blockshard.fully_shard(Block())  # the control
    assert not [w for w in recwarn if "stay whole" in str(w.message)]
