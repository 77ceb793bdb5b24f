"""torchao ``NF4Tensor`` frozen weights with LoRA-style adapters, built in code (threaded ranks).

Every function takes ``(rank, world, ...)``; ``world == 0`` is one process without sharding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# (in, out) per layer: 2, 3 and 6 super-blocks of 16384 values; 128 rows do not split into whole
# super-block rows at W = 3 (torchao's FSDP2 hooks cut dim 0 only)
SHAPES = ((256, 128), (128, 384), (384, 256))


class NF4LoRALinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int = 4) -> None:
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        w = torch.randn(out_features, in_features, dtype=torch.bfloat16) / math.sqrt(in_features)
        self.weight = nn.Parameter(to_nf4(w), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, in_features, dtype=torch.bfloat16) / math.sqrt(in_features))
        self.lora_b = nn.Parameter(torch.randn(out_features, rank, dtype=torch.bfloat16) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + (x @ self.lora_a.t()) @ self.lora_b.t()


class NF4Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.layers = nn.ModuleList(NF4LoRALinear(i, o) for i, o in SHAPES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.silu(layer(x))
        return x


def _serial():
    from _qlora import _serial as serial

    return serial()


def _batch(step: int) -> torch.Tensor:
    from _adapters import batch

    return batch(step, SHAPES[0][0])


def train(rank: int, world: int, steps: int = 2, stock_fsdp2: bool = False) -> dict:
    """Logits and LoRA gradients of the first step, LoRA weights after ``steps`` AdamW steps
    (``_adapters.train``); ``stock_fsdp2``: the error of stock FSDP2 over these weights."""
    from _adapters import train as train_adapters

    with _serial():
        model = NF4Stack()
    if stock_fsdp2:
        from torch.distributed.fsdp import fully_shard

        try:
            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
            model(_batch(0)).float().square().mean().backward()
        except Exception as e:  # torchao's hooks: whole super-blocks per rank, dim 0 only
            return {"error": f"{type(e).__name__}: {e}"}
        return {"error": ""}
    return train_adapters(model, rank, world, _batch, steps)


def run(rank: int, world: int, sharded: bool) -> dict:
    """Spawned ranks: :func:`train` sharded, or the reference."""
    return train(rank, world if sharded else 0)
