"""Blockwise FP8 (128 x 128 tiles, DeepSeek-V3 style) frozen weights with a pure-torch reference
quantizer, a module shaped like transformers' ``FP8Linear`` (``weight`` float8, ``weight_scale_inv``
fp32, ``block_size``) and bf16 adapters. ``(rank, world, ...)``; ``world == 0``: one process."""

from __future__ import annotations

import math

import torch
from torch import nn

from blockshard._tiny import dequantize_fp8_block, quantize_fp8_block

__all__ = [
    "EXPERT_SHAPES",
    "SHAPES",
    "FP8BlockLinear",
    "FP8ExpertStack",
    "FP8Stack",
    "dequantize_fp8_block",
    "quantize_fp8_block",
    "run",
    "train",
    "train_experts",
]

# rows 320 = 2.5 tile stripes, cols 192 = 1.5 tiles: tails in both dims
SHAPES = ((192, 320), (320, 256), (256, 192))


class FP8BlockLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int = 4) -> None:
        super().__init__()
        self.block_size = (128, 128)
        w = torch.randn(out_features, in_features) / math.sqrt(in_features)
        q, scale = quantize_fp8_block(w, self.block_size)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, in_features, dtype=torch.bfloat16) / math.sqrt(in_features))
        self.lora_b = nn.Parameter(torch.randn(out_features, rank, dtype=torch.bfloat16) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block_size, x.dtype)
        return torch.nn.functional.linear(x, w) + (x @ self.lora_a.t()) @ self.lora_b.t()


class FP8Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.layers = nn.ModuleList(FP8BlockLinear(i, o) for i, o in SHAPES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.silu(layer(x))
        return x


# GPT-OSS-shaped experts scaled down (2880-row experts: 22.5 stripes of 128): 180 rows = 5 tiles of
# 32 and a 20-row edge, 360 columns = 11 tiles and an 8-column edge; the second layer transposed
EXPERT_SHAPES = ((4, 180, 360), (4, 360, 180))
EXPERT_TILE = (32, 32)


class FP8Experts(nn.Module):
    """Stacked frozen blockwise-FP8 experts: ``weight`` float8 ``(E, out, in)``, ``weight_scale_inv``
    fp32 ``(E, ceil(out / B), ceil(in / B))``, ``block_size``; every expert sees the whole input and
    their outputs are summed; bf16 adapters per expert."""

    def __init__(self, experts: int, out_features: int, in_features: int, rank: int = 4) -> None:
        super().__init__()
        self.block_size = EXPERT_TILE
        w = torch.randn(experts, out_features, in_features) / math.sqrt(in_features)
        q, scale = quantize_fp8_block(w, self.block_size)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        self.lora_a = nn.Parameter(
            torch.randn(experts, rank, in_features, dtype=torch.bfloat16) / math.sqrt(in_features)
        )
        self.lora_b = nn.Parameter(torch.randn(experts, out_features, rank, dtype=torch.bfloat16) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block_size, x.dtype)
        h = torch.einsum("bi,eri->ber", x, self.lora_a)
        return (torch.einsum("bi,eoi->beo", x, w) + torch.einsum("ber,eor->beo", h, self.lora_b)).sum(dim=1)


class FP8ExpertLayer(nn.Module):
    def __init__(self, shape: tuple[int, int, int]) -> None:
        super().__init__()
        self.experts = FP8Experts(*shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(self.experts(x))


class FP8ExpertStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(1)
            self.layers = nn.ModuleList(FP8ExpertLayer(s) for s in EXPERT_SHAPES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def train_experts(rank: int, world: int, steps: int = 2, tile_placement: bool | str = False) -> dict:
    """:func:`train` of the stacked-expert stack (``EXPERT_SHAPES``, 32 x 32 tiles)."""
    from _adapters import batch
    from _adapters import train as train_adapters
    from _qlora import _serial

    with _serial():
        model = FP8ExpertStack()
    shard = {"tile_placement": tile_placement} if tile_placement else {}
    return train_adapters(model, rank, world, lambda step: batch(step, EXPERT_SHAPES[0][2]), steps, **shard)


def train(rank: int, world: int, steps: int = 2, tile_placement: bool | str = False) -> dict:
    """Logits and adapter gradients of the first step, adapters after ``steps`` AdamW steps
    (``_adapters.train``); ``tile_placement``: fully_shard's (True: the FP8 weights placed by tiles)."""
    from _adapters import batch
    from _adapters import train as train_adapters
    from _qlora import _serial

    with _serial():
        model = FP8Stack()
    shard = {"tile_placement": tile_placement} if tile_placement else {}
    return train_adapters(model, rank, world, lambda step: batch(step, SHAPES[0][0]), steps, **shard)


def run(rank: int, world: int, sharded: bool, tile_placement: bool = False, experts: bool = False) -> dict:
    """Spawned ranks: :func:`train` (``experts``: :func:`train_experts`) sharded (by stripes, or by
    tiles), or the reference."""
    return (train_experts if experts else train)(rank, world if sharded else 0, tile_placement=tile_placement)
