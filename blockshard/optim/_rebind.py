"""``rebind_optimizer``: an optimizer built before ``fully_shard``, pointed at the pieces.

[Note: a reused optimizer]
Accelerate's documented order builds the optimizers over the unsharded model and passes them to
``accelerator.prepare(model, optimizer)``, which shards the model; the HF Trainer does the same in
``create_optimizer``. ``fully_shard`` replaces every parameter by this rank's piece, so such an
optimizer holds objects that never get a gradient again. :func:`rebind_optimizer` makes it step
the pieces, by parameter name, before its first step:

* an element-wise optimizer (AdamW, SGD, 8-bit AdamW: its blocks are whole in the storage) gets
  the pieces in its ``param_groups``, empty ones too ([Note: empty pieces hold no state]); it is
  the optimizer to step;
* an optimizer that computes on whole units (``torch.optim.Muon``'s matrices, BlockedShampoo's
  tiles) cannot step a piece: a cut matrix would be orthogonalized per stripe, an empty ``(0,)``
  piece is refused ("Param gradient must be a 2D matrix"). It is *reused* as the inner optimizer of
  an :class:`~blockshard.optim.OwnerComputeOptimizer` over the same named parameters: its
  ``param_groups`` (every hyperparameter, an LR scheduler's ``initial_lr`` too) are kept, their
  ``params`` become this rank's compute tensors (whole matrices where they lie, the full matrices
  it owns where ``policy="owner" | "auto"`` cut them), and the wrapper is the optimizer to step.
  An LR scheduler built on the original keeps working (the wrapper's ``param_groups`` are the
  original's). Stepping the original directly would skip the owner exchange, so it raises, naming
  the wrapper;
* an ``OwnerComputeOptimizer`` (or ``blockshard.optim.Muon``) built before sharding is rebuilt in
  place over the pieces (:meth:`~blockshard.optim.OwnerComputeOptimizer.follow`).

It is collective (the owner plans are compared across ranks): every rank calls it, at the same
point, with optimizers of the same kinds. An optimizer that has stepped cannot be moved (its state
describes whole tensors): it raises.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from blockshard.optim._owner_compute import OwnerComputeError
from blockshard.optim._owner_optimizer import OwnerComputeOptimizer
from blockshard.optim._semantics import computes_on_whole_units
from blockshard.runtime.core._param import managed_tag

__all__ = ["rebind_optimizer"]


def rebind_optimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module, *, names: Mapping[int, str] | None = None
) -> torch.optim.Optimizer:
    """Collective: make ``optimizer`` (built over ``model``'s parameters, before or after
    ``fully_shard``) step ``model``'s current pieces, and return the optimizer to step: the same
    object, or an :class:`~blockshard.optim.OwnerComputeOptimizer` reusing it for an optimizer that
    computes on whole units ([Note: a reused optimizer]). ``names``: ``id(parameter) -> name`` of
    the parameters as they were before sharding (``{id(p): n for n, p in model.named_parameters()}``
    taken then); without it only the model's current parameters are recognised. An optimizer over
    none of ``model``'s parameters is returned as it is."""
    current = dict(model.named_parameters())
    by_id = {id(p): n for n, p in current.items()}
    known = {**(names or {}), **by_id}
    if isinstance(optimizer, OwnerComputeOptimizer):
        optimizer.follow(current, known)
        return optimizer
    if _outer_of(optimizer) is not None:
        return optimizer  # already reused (prepared twice)
    if not any(id(p) in known for g in optimizer.param_groups for p in g["params"]):
        return optimizer  # over another model's parameters: not ours to move
    stale = False
    named: list[tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]] = []
    for i, group in enumerate(optimizer.param_groups):
        pairs: list[tuple[str, torch.Tensor]] = []
        for j, p in enumerate(group["params"]):
            name = known.get(id(p))
            if name is None:
                raise OwnerComputeError(
                    f"{type(optimizer).__name__} holds a tensor of shape {tuple(p.shape)} (param_groups[{i}]['params']"
                    f"[{j}]) that is not a parameter of the model being sharded. Fix: build it over "
                    "model.parameters() (or named subsets of them) of the model you prepare"
                )
            stale |= current[name] is not p
            pairs.append((name, current[name]))
        named.append(({k: v for k, v in group.items() if k not in ("params", "param_names")}, pairs))
    if stale and any(optimizer.state.values()):
        raise OwnerComputeError(
            f"{type(optimizer).__name__} has stepped already, and fully_shard replaced its parameters since: its "
            "state describes whole tensors and cannot move onto the pieces. Fix: shard (accelerator.prepare) "
            "before the first step"
        )
    sharded = any(managed_tag(p) is not None for _, pairs in named for _, p in pairs)
    if not (sharded and computes_on_whole_units(optimizer)):
        for group, (_, pairs) in zip(optimizer.param_groups, named, strict=True):
            group["params"] = [p for _, p in pairs]
        return optimizer
    reused = _Reused(optimizer)
    outer = OwnerComputeOptimizer(reused, [{**opts, "params": pairs} for opts, pairs in named])
    reused.outer = weakref.ref(outer)
    return outer


# optimizer -> its factory, weakly both ways (the optimizer's step hook and its wrapper keep the
# factory alive): a value that held its key would keep every reused optimizer for the process
_REUSED: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[_Reused]] = weakref.WeakKeyDictionary()


def _outer_of(optimizer: torch.optim.Optimizer) -> OwnerComputeOptimizer | None:
    ref = _REUSED.get(optimizer)
    reused = None if ref is None else ref()
    return None if reused is None or reused.outer is None else reused.outer()


class _Reused:
    """The inner-optimizer factory of [Note: a reused optimizer]: hands the optimizer itself back,
    its ``param_groups``' ``params`` replaced by the compute tensors, and refuses a step of it
    that its wrapper did not make."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.outer: weakref.ref[OwnerComputeOptimizer] | None = None
        self._hooked = False

    def __call__(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        opt = self.optimizer
        if len(groups) != len(opt.param_groups):  # cannot happen: one inner group per given group
            raise OwnerComputeError(f"{type(opt).__name__}: {len(groups)} groups for {len(opt.param_groups)}")
        for mine, given in zip(opt.param_groups, groups, strict=True):
            mine["params"] = list(given["params"])
            mine.pop("param_names", None)  # the compute tensors are not the named parameters
        opt.state.clear()
        if not self._hooked:
            opt.register_step_pre_hook(self._pre_step)
            self._hooked = True
        _REUSED[opt] = weakref.ref(self)
        return opt

    def _pre_step(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        outer = None if self.outer is None else self.outer()
        if outer is not None and not outer._stepping_inner:
            raise OwnerComputeError(
                f"this {type(optimizer).__name__} was handed to an OwnerComputeOptimizer when its model was sharded "
                "(accelerator.prepare or blockshard.optim.rebind_optimizer): its param_groups now hold whole "
                "matrices at their owner ranks, which only the wrapper's step fills. Fix: step the optimizer "
                "that prepare returned (optimizer = accelerator.prepare(optimizer)), not the one you built"
            )
