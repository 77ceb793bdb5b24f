"""``model.to(dtype)`` / ``.half()`` / ``.double()`` after ``fully_shard`` ([Note: converting a sharded
model] in blockshard/runtime/core/_module.py), for test_fast_convert.py: the same training with
blockshard, with stock FSDP2 (torch's ``fully_shard``) and on one process. Top-level functions, so
threaded and spawned ranks can run them."""

from __future__ import annotations

import _inproc
import torch
from torch import nn

from blockshard._tiny import OddMLP, mlp_batches
from blockshard.runtime import ShardingError

STEPS = 3
HOW = {
    "double": (lambda m: m.double(), torch.float64),
    "to_float64": (lambda m: m.to(torch.float64), torch.float64),
    "bfloat16": (lambda m: m.bfloat16(), torch.bfloat16),
    "half": (lambda m: m.half(), torch.float16),
}


def _shard(model: nn.Module, engine: str, mp: bool) -> None:
    if engine == "none":
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from blockshard import fully_shard
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32)} if mp else {}
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def _full(model: nn.Module, engine: str) -> dict[str, torch.Tensor]:
    if engine == "fsdp2":
        return {n: p.full_tensor() for n, p in model.named_parameters()}
    if engine == "blockshard":
        import blockshard

        return dict(blockshard.full_state_dict(model))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_converted(_rank: int, _world: int, engine: str, how: str, mp: bool = False) -> dict:
    """Shard an fp32 ``OddMLP`` with ``engine`` ("blockshard", "fsdp2" or "none"), convert it with
    ``how``, then build AdamW and train ``STEPS`` steps, every rank the whole batch (in the new dtype)."""
    with _inproc.serial():
        model = OddMLP()
    _shard(model, engine, mp)
    convert, dtype = HOW[how]
    assert convert(model) is model
    local_dtypes = sorted({str(p.dtype) for p in model.parameters()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)  # an eps float16 holds
    losses = []
    for x, y in mlp_batches(STEPS, 4):
        loss = ((model(x.to(dtype)) - y.to(dtype)) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float().item())
    full = _full(model, engine)
    return {"params": full, "losses": losses, "local_dtypes": local_dtypes}


def optimizer_before_conversion(_rank: int, _world: int) -> str:
    """An optimizer built over the pieces, then ``model.double()``: its first step raises."""
    with _inproc.serial():
        model = OddMLP()
    _shard(model, "blockshard", False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.double()
    x, y = mlp_batches(1, 4)[0]
    ((model(x.double()) - y.double()) ** 2).mean().backward()
    try:
        opt.step()
    except ShardingError as e:
        return str(e)
    return "stepped"


def converted_with_gradients(_rank: int, _world: int) -> str:
    """``model.double()`` after a backward, before ``zero_grad``: refused (the gradients would stay fp32)."""
    with _inproc.serial():
        model = OddMLP()
    _shard(model, "blockshard", False)
    x, y = mlp_batches(1, 4)[0]
    ((model(x) - y) ** 2).mean().backward()
    try:
        model.double()
    except ShardingError as e:
        message = str(e)
    else:
        return "converted"
    model.zero_grad()  # set_to_none: the fix the message names
    model.double()
    return message + " | then: " + str(next(model.parameters()).dtype)
