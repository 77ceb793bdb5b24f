"""bitsandbytes ``GlobalOptimManager`` overrides follow a parameter onto the hook's views.

bitsandbytes 0.50 keys per-parameter overrides on parameter objects and on positions
(``bitsandbytes/optim/optimizer.py``): ``override_config(p, ...)`` writes ``pid2config[id(p)]``;
``register_module_override(module, "weight", cfg)`` (what the HF Trainer does for every
``nn.Embedding`` under ``optim="adamw_bnb_8bit"``: 32-bit state) is resolved at the optimizer's
first step by ``check_overrides``, which looks for ``id(module.weight)`` among the optimizer's
parameters and writes ``pid2config`` and ``index2config[(gindex, pindex)]``; ``get_config`` reads
``index2config[(gindex, pindex)]`` and then ``pid2config[id(p)]`` at every ``init_state`` and
``update_step``. With the hook the optimizer holds views, not the parameters, so every such lookup
misses and the embedding gets 8-bit state (1.5e-4 from one process after 4 Trainer steps).

:func:`follow_overrides` gives each view its parameter's config for one ``_optimizer_step``:
``pid2config[id(view)]`` is the parameter's config dict itself (so a later ``override_config`` on
the parameter reaches the view) and ``index2config`` holds, at the positions DeepSpeed steps
(ZeRO-1/2's ``_optimizer_step`` leaves one ``param_group``, so ``gindex`` is 0; ZeRO-3 steps the
group in place, at its own position), exactly the views' configs;
the previous ``index2config`` entries at those positions are restored afterwards, since the table
is process-wide and another bitsandbytes optimizer may use the same positions.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from bitsandbytes.optim import GlobalOptimManager

__all__ = ["follow_overrides"]


def _manager(optimizer: torch.optim.Optimizer) -> GlobalOptimManager | None:
    """The ``GlobalOptimManager`` of a bitsandbytes optimizer; ``None`` for any other optimizer."""
    bnb_optimizer = sys.modules.get("bitsandbytes.optim.optimizer")
    if bnb_optimizer is None or not isinstance(optimizer, bnb_optimizer.Optimizer8bit):
        return None
    mng: GlobalOptimManager = optimizer.mng
    return mng


def resolve_module_overrides(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
    """What ``check_overrides`` does on one process, for the hook's parameters (called once, first step).

    ``pid2config[id(p)]`` becomes the ``register_module_override`` config of every parameter ``p`` in
    ``params`` that a registered module holds (the last registration wins, as in bitsandbytes).
    """
    mng = _manager(optimizer)
    if mng is None:
        return
    ours = {id(p) for p in params}
    for module, attr, config in mng.module_weight_config_triple:
        p = getattr(module, attr, None)
        if p is not None and id(p) in ours:
            mng.pid2config[id(p)] = config


@contextlib.contextmanager
def follow_overrides(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    views: Sequence[tuple[torch.Tensor, int]],
    gindex: int = 0,
) -> Iterator[None]:
    """During the block: view ``k`` (``(tensor, index into params)``) carries ``params[index]``'s config;
    ``gindex``: the position of the ``param_group`` holding the views (ZeRO-3 steps the group in place,
    ZeRO-1/2 alone as group 0)."""
    mng = _manager(optimizer)
    if mng is None:
        yield
        return
    saved = {}
    for k, (view, index) in enumerate(views):
        config = mng.pid2config.get(id(params[index]))
        saved[(gindex, k)] = mng.index2config.pop((gindex, k), None)
        if config is None:
            mng.pid2config.pop(id(view), None)
        else:
            mng.pid2config[id(view)] = config
            mng.index2config[(gindex, k)] = config
    try:
        yield
    finally:
        for key, config in saved.items():
            mng.index2config.pop(key, None)
            if config is not None:
                mng.index2config[key] = config
