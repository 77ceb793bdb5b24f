"""``param_groups_by``: optimizer param_groups chosen by name and global shape, the same on every
rank and the same as on one process ([Note: first-step optimizer checks] in
blockshard/runtime/core/_optim_checks.py explains what a choice by the piece's shape does)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

from torch import nn

from blockshard._errors import ShardingError
from blockshard.runtime import global_shape

__all__ = ["param_groups_by"]


def param_groups_by(
    model: nn.Module,
    key: Callable[[str, tuple[int, ...]], Hashable],
    options: Mapping[Hashable, Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """One param_group per key of ``options``, in its order, holding every trainable parameter
    (``requires_grad``) for which ``key(name, global_shape)`` returns that key, with the key's
    options and ``param_names``.

    ``name`` is the ``model.named_parameters()`` name and ``global_shape`` the whole tensor's shape
    (:func:`blockshard.global_shape`), whether ``model`` is sharded (before or after ``fully_shard``,
    any world size) or not, so every rank and one process build the same param_groups. Empty pieces
    are kept (a rank holding nothing of a tensor still lists it). Nanogpt-style weight decay::

        groups = blockshard.param_groups_by(
            model,
            lambda name, shape: "decay" if len(shape) >= 2 else "no_decay",
            {"decay": {"weight_decay": 0.1}, "no_decay": {"weight_decay": 0.0}},
        )
        optimizer = torch.optim.AdamW(groups, lr=1e-3)

    A key not among ``options`` raises :class:`~blockshard.runtime.ShardingError` naming the
    parameter; a key no parameter chose gives an empty param_group (torch accepts it).
    """
    if not options:
        raise ShardingError("param_groups_by: options is empty; give one entry per key, e.g. {'all': {}}")
    groups: dict[Hashable, dict[str, Any]] = {
        k: {"params": [], "param_names": [], **dict(v)} for k, v in options.items()
    }
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        shape = tuple(global_shape(p))
        chosen = key(name, shape)
        group = groups.get(chosen)
        if group is None:
            raise ShardingError(
                f"param_groups_by: key({name!r}, {shape}) returned {chosen!r}, which is not among the options' keys "
                f"{list(options)}. Fix: add options for {chosen!r} or return one of those keys"
            )
        group["params"].append(p)
        group["param_names"].append(name)
    return list(groups.values())
