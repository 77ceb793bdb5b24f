"""Parameters of a model sharded on the meta device: initialized as the unsharded model would be.

[Note: meta init]
A model too large for one rank is built under ``torch.device("meta")`` (no storage), sharded,
then materialized: ``model.to_empty(device=...)`` gives every group real, uninitialized local
buffers (``ParamBuffers.materialize``; nothing else is allocated), and
:func:`init_parameters` fills them. It visits ``model.modules()`` in order, as
``for m in model.modules(): m.reset_parameters()`` on the unsharded model does, and calls
``init(m)`` (default: ``m.reset_parameters()`` for modules with parameters of their own) on *full*
views of ``m``'s parameters: the first module of a group allocates the group's gathered buffer
and puts its unsharded parameters in place; after the group's last module, each rank copies its
own segment into its local buffer and frees the gathered one. So every rank draws the same
random numbers in the same order as one process does, and with the same seed the result equals
unsharded initialization bitwise; no rank holds more than its shard plus the groups whose
modules are being visited (the root's group, whose modules come first and last in
``model.modules()``, stays gathered throughout).
``init`` must initialize the module's own parameters in place (``nn.init.*_``,
``param.data.normal_()``, Hugging Face's ``_init_weights``); replacing one raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from blockshard._errors import ShardingError
from blockshard.runtime.core._buffers import ParamBuffers
from blockshard.runtime.core._common import ShardedState
from blockshard.runtime.core._state import state_of

__all__ = ["init_parameters"]


def _reset(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if module._parameters and callable(reset):
        reset()


@torch.no_grad()
def init_parameters(
    model: nn.Module, init: Callable[[nn.Module], None] | None = None, *, order: str = "modules"
) -> nn.Module:
    """Initialize a sharded model's parameters as the unsharded model's would be, one group at a
    time (see [Note: meta init]); ``init(module)`` defaults to ``module.reset_parameters()``.
    ``order``: ``"modules"`` visits ``model.modules()`` (a ``for m in model.modules()`` loop),
    ``"apply"`` children before parents, as ``model.apply(init)`` does."""
    if init is not None and not callable(init):
        raise ShardingError(f"init={init!r} must be a callable taking a module, e.g. model._init_weights")
    if order not in ("modules", "apply"):
        raise ShardingError(f"order={order!r} must be 'modules' (model.modules()) or 'apply' (model.apply(init))")
    run = init or _reset
    visit = list(model.modules()) if order == "modules" else list(_post_order(model))
    groups: list[ParamBuffers] = []
    holders: dict[int, list[ParamBuffers]] = {}  # a module's parameters may lie in several ([Note: mixed dtypes])
    for m in model.modules():
        st = state_of(m)
        for g in st.param_buffers if st is not None else []:
            if g.layout is None or any(g is seen for seen in groups):
                continue  # a list's group is met at each of its modules
            groups.append(g)
            for sp in g.params:
                for ref in sp.refs:
                    mine = holders.setdefault(id(ref.module), [])
                    if not any(g is o for o in mine):
                        mine.append(g)
            if g.sharded_state is not ShardedState.SHARDED or g.device.type == "meta":
                raise ShardingError(
                    f"init_parameters: group {g.name!r} is "
                    + (
                        "on the meta device: call model.to_empty(device=...) first"
                        if g.device.type == "meta"
                        else "gathered: call it between steps, not inside forward or backward"
                    )
                )
    remaining: dict[int, int] = {}
    for m in visit:
        for g in holders.get(id(m), []):
            remaining[id(g)] = remaining.get(id(g), 0) + 1
    opened: dict[int, ParamBuffers] = {}
    try:
        for m in visit:
            mine = holders.get(id(m), [])
            for g in mine:
                if id(g) not in opened:
                    opened[id(g)] = g
                    _open(g)
            run(m)
            for g in mine:
                remaining[id(g)] -= 1
                if remaining[id(g)] == 0:
                    _close(g)
                    del opened[id(g)]
    finally:
        for g in opened.values():  # init raised: leave the groups sharded (their values unset)
            for sp in g.params:
                sp.set_module_params(sp.sharded)
            g._free_gathered()
    return model


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def _open(group: ParamBuffers) -> None:
    group._alloc_gathered()
    for lo, hi in group.holes:
        group.gathered[lo:hi].zero_()
    for sp in group.params:
        sp.set_module_params(sp.unsharded)


def _close(group: ParamBuffers) -> None:
    layout, W, r = group.layout, group.world_size, group.rank
    assert layout is not None
    for sp in group.params:
        for ref in sp.refs:
            if ref.module._parameters.get(ref.attr) is not sp.unsharded:
                raise ShardingError(
                    f"init replaced parameter {sp.fqn!r} of group {group.name!r} instead of initializing it in "
                    "place. Fix: initialize in place (torch.nn.init.*_, param.data.normal_(), param.copy_(...))"
                )
    for b, S_b in enumerate(layout.buckets):
        off = layout.bucket_local_offset(b)
        group.local[off : off + S_b].copy_(group.gathered[W * off + r * S_b : W * off + (r + 1) * S_b])
    for sp in group.params:
        sp.set_module_params(sp.sharded)
    group._free_gathered()
