"""Optimizer state of a sharded model by parameter name, with global shapes: what DCP can reshard.

[Note: optimizer state entries]
An optimizer over the sharded parameters keeps per-parameter state of the *piece's* block shape
(AdamW's ``exp_avg``, Muon's ``momentum_buffer``): such a tensor is an element-wise companion of
the piece, so it becomes a :class:`PieceTensor` of the parameter's global shape and the same
boxes, and DCP reshards it exactly like the parameter. A one-element tensor that is not a piece
(AdamW's ``step``) is the same on every rank (every rank steps every parameter) and is saved
once. Any other state (bitsandbytes' ``absmax`` per 256-block, torchao's quantized subclasses,
BlockedShampoo's per-block lists) is not a companion of the piece yet: it raises
:class:`~blockshard.runtime.CheckpointError` naming the key instead of being saved as if every
rank held the same value (DCP keeps one rank's copy of a plain entry).
The layout is FQN-keyed, as ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``:
``{"state": {name: {key: value}}, "param_groups": [{hyperparameters..., "params": [names]}]}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from blockshard.runtime._api import _join, _states_under
from blockshard.runtime._optim_guard import uncounted_steps
from blockshard.runtime._param import ShardedParam
from blockshard.runtime._piece_tensor import PieceTensor

__all__ = ["load_optimizer_state_dict", "optimizer_state_dict"]

_SCALARS = (int, float, bool, str, type(None))


def _by_param(model: nn.Module) -> dict[int, tuple[str, ShardedParam | None]]:
    """``id(param) -> (name, sharded param or None)`` for what ``model.parameters()`` yields."""
    out: dict[int, tuple[str, ShardedParam | None]] = {
        id(sp.sharded): (_join(prefix, sp.fqn), sp) for prefix, st in _states_under(model) for sp in st.group.params
    }
    gathered = {id(sp.unsharded) for _, st in _states_under(model) for sp in st.group.params}
    for name, p in model.named_parameters():  # parameters outside any group
        if id(p) not in out and id(p) not in gathered:
            out[id(p)] = (name, None)
    return out


def _optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, nn.Parameter, Any]]:
    from blockshard.runtime._checkpoint import CheckpointError

    names = _by_param(model)
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(
                    f"the optimizer holds a tensor of shape {tuple(p.shape)} that is not a parameter of the model. "
                    "Fix: build the optimizer over model.parameters() after fully_shard"
                )
            name, sp = names[id(p)]
            out.append((name, p, sp))
    return out


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of trainable parameters that have none yet (a fresh optimizer, or a
    parameter that never had a gradient) with one step at learning rate 0 that sees a zero
    gradient for those parameters only (the others' gradients are hidden, so their state is not
    touched), as torch's ``set_optimizer_state_dict`` does; a fresh optimizer then has tensors
    for ``dcp.load`` to fill. The parameters do not change (an update scaled by 0)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    missing = {id(p) for p in params if p.requires_grad and not optimizer.state.get(p)}
    if not missing:
        return
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    for p in params:
        p.grad = torch.zeros_like(p) if id(p) in missing else None
    try:
        with uncounted_steps():  # not a training step ([Note: collective integrity])
            optimizer.step()
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state by parameter name, piece-shaped tensors as :class:`PieceTensor`
    entries of the global shape (views of the live state; see [Note: optimizer state entries]).
    State that does not exist yet is created first (:func:`init_optimizer_state`)."""
    init_optimizer_state(optimizer)
    state: dict[str, dict[str, Any]] = {}
    for name, p, sp in _optimizer_params(model, optimizer):
        entries = optimizer.state.get(p)
        if entries:
            state[name] = {k: _entry(name, k, v, p, sp) for k, v in entries.items()}
    groups = []
    names = iter(n for n, _, _ in _optimizer_params(model, optimizer))
    for g in optimizer.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append(hyper | {"params": [next(names) for _ in g["params"]]})
    return {"state": state, "param_groups": groups}


def _entry(name: str, key: str, value: object, p: torch.Tensor, sp: ShardedParam | None) -> object:
    from blockshard.runtime._checkpoint import CheckpointError

    if isinstance(value, _SCALARS):
        return value
    if not isinstance(value, torch.Tensor) or type(value) is not torch.Tensor:
        raise CheckpointError(
            f"optimizer state {key!r} of parameter {name!r} is a {type(value).__name__}, which blockshard cannot "
            "place in the global tensor yet (quantized or per-block state). Fix: checkpoint this optimizer with "
            "optimizer.state_dict() and reload it at the same world size and semantics"
        )
    if sp is None or (value.dim() == 0 and p.dim() != 0):
        if sp is not None and value.numel() != 1:
            raise AssertionError("a 0-d tensor has one element")
        return value  # the same on every rank (a parameter outside any group, a step count)
    if tuple(value.shape) == tuple(p.shape):
        return PieceTensor(value, sp.local_start, sp.shape, name=f"{name}.{key}")
    raise CheckpointError(
        f"optimizer state {key!r} of parameter {name!r} has shape {tuple(value.shape)}, neither the piece's "
        f"{tuple(p.shape)} nor a scalar (e.g. bitsandbytes' absmax per 256-block): blockshard cannot place it in "
        "the global tensor yet. Fix: checkpoint this optimizer with optimizer.state_dict() and reload it at "
        "the same world size and semantics"
    )


@torch.no_grad()
def load_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Copy a state dict of :func:`optimizer_state_dict`'s form into the optimizer (the entries
    ``dcp.load`` filled in place are copied onto themselves; other pieces must match this rank's)."""
    from blockshard.runtime._checkpoint import CheckpointError

    params = _optimizer_params(model, optimizer)
    names = [n for n, _, _ in params]
    saved_names = [n for g in state["param_groups"] for n in g["params"]]
    if saved_names != names:
        raise CheckpointError(
            f"the optimizer state is for parameters {saved_names[:5]}..., this optimizer holds {names[:5]}... "
            "(another model or another optimizer set-up). Fix: load the state of this optimizer"
        )
    init_optimizer_state(optimizer)
    for name, p, _ in params:
        live = optimizer.state[p]
        for key, value in state["state"].get(name, {}).items():
            have = live.get(key)
            if isinstance(value, PieceTensor):
                if not isinstance(have, torch.Tensor) or value.to_local().numel() != have.numel():
                    raise CheckpointError(
                        f"optimizer state {key!r} of parameter {name!r}: the state dict holds piece "
                        f"[{value.local_start}, {value.local_start + value.to_local().numel()}), not this rank's "
                        "(another world size or semantics). Fix: load it through dcp.load into "
                        "blockshard.optimizer_state_dict(model, optimizer)"
                    )
                value = value.to_local().view(have.shape)
            if isinstance(have, torch.Tensor) and isinstance(value, torch.Tensor):
                if value.shape != have.shape:
                    raise CheckpointError(
                        f"optimizer state {key!r} of parameter {name!r}: saved shape {tuple(value.shape)}, "
                        f"this rank's {tuple(have.shape)}. Fix: load it through dcp.load into "
                        "blockshard.optimizer_state_dict(model, optimizer)"
                    )
                if value.data_ptr() != have.data_ptr():
                    have.copy_(value)
            else:
                live[key] = value
    for g, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        g.update({k: v for k, v in saved.items() if k != "params"})
