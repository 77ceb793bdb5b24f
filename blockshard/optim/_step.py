"""What every optimizer's ``step(closure)`` does first: the closure's loss, with grad enabled."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["closure_loss"]


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """``closure()`` under ``torch.enable_grad()`` (a step runs under ``no_grad``); None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
