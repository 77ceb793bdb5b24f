"""torchao ``MXTensor`` (MXFP8, MXFP4) frozen weights with LoRA-style adapters, built in code.

The forward dequantizes the weight (torchao's ``F.linear`` on an MX weight is not implemented for
weight-only use on this CPU build) and adds a bf16 adapter. Every function takes ``(rank, world,
...)``; ``world == 0`` is one process without sharding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# last dims: multiples of 32 (whole 1 x 32 blocks); 96 x 160 = 15360 values = 480 blocks
SHAPES = ((160, 96), (96, 224), (224, 160))


class MXLoRALinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, elem: str, rank: int = 4) -> None:
        super().__init__()
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

        w = torch.randn(out_features, in_features, dtype=torch.bfloat16) / math.sqrt(in_features)
        self.weight = nn.Parameter(MXTensor.to_mx(w, getattr(torch, elem), block_size=32), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, in_features, dtype=torch.bfloat16) / math.sqrt(in_features))
        self.lora_b = nn.Parameter(torch.randn(out_features, rank, dtype=torch.bfloat16) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.dequantize(x.dtype)
        return torch.nn.functional.linear(x, w) + (x @ self.lora_a.t()) @ self.lora_b.t()


class MXStack(nn.Module):
    def __init__(self, elem: str) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.layers = nn.ModuleList(MXLoRALinear(i, o, elem) for i, o in SHAPES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.silu(layer(x))
        return x


def _inputs(step: int) -> torch.Tensor:
    from _adapters import batch

    return batch(step, 256)[:, : SHAPES[0][0]]  # the first 160 columns of the NF4 runs' batch


def stock_fsdp2(rank: int, world: int, elem: str = "float8_e4m3fn") -> dict:
    """Stock FSDP2 over the MXTensor weights: the error of sharding them or of the first step."""
    from _qlora import _serial
    from torch.distributed.fsdp import fully_shard

    with _serial():
        model = MXStack(elem)
    try:
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        model(_inputs(0)).float().square().mean().backward()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": ""}


def train(rank: int, world: int, elem: str = "float8_e4m3fn", steps: int = 2) -> dict:
    """Logits and adapter gradients of the first step, adapters after ``steps`` AdamW steps
    (``_adapters.train``)."""
    from _adapters import train as train_adapters
    from _qlora import _serial

    with _serial():
        model = MXStack(elem)
    return train_adapters(model, rank, world, _inputs, steps)
