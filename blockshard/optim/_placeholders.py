"""Optimizer constructors over DeepSpeed ZeRO-3 placeholders.

Under ``deepspeed.zero.Init`` each parameter is a 1-D placeholder until DeepSpeed gathers it; its
shape is kept as ``ds_shape``. A constructor that checks shapes (torch's ``Muon``: "Muon only
supports 2D parameters") refuses such placeholders. :func:`construct_over_stand_ins` builds the
optimizer over meta tensors of the full shapes, then puts the real parameters back into its
``param_groups`` (what ``deepspeed.initialize`` and the steps read).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["construct_over_stand_ins"]

_O = TypeVar("_O", bound=torch.optim.Optimizer)


def construct_over_stand_ins(build: Callable[[list[Any]], _O], params: Any) -> _O:
    """``build(args)`` where ``args`` is ``params`` (tensors, or param_group dicts) with each ZeRO-3
    placeholder replaced by a meta tensor of its ``ds_shape``; then every param_group
    of the optimizer it returns holds the real parameters again. ``params``' own dicts are never
    changed (the stand-ins sit in copies), so nothing needs putting back when ``build`` raises."""
    real: dict[int, torch.Tensor] = {}

    def stand_in(p: Any) -> Any:
        shape = getattr(p, "ds_shape", None)
        if not isinstance(p, torch.Tensor) or shape is None or tuple(shape) == tuple(p.shape):
            return p
        t = torch.empty(tuple(shape), dtype=p.dtype, device="meta", requires_grad=p.requires_grad)
        real[id(t)] = p
        return t

    listed: list[Any] = [params] if isinstance(params, torch.Tensor) else list(params)
    if listed and isinstance(listed[0], dict):
        args: list[Any] = []
        for g in listed:
            ps = g["params"]
            args.append({**g, "params": [stand_in(p) for p in ([ps] if isinstance(ps, torch.Tensor) else ps)]})
    else:
        args = [stand_in(p) for p in listed]
    out = build(args)
    for g in out.param_groups:
        g["params"] = [real.get(id(t), t) for t in g["params"]]
    return out
