"""What ``initialize`` hands the hooked ZeRO optimizer it is about to build (one engine at a time per
thread): the parsed ``"blockshard"`` section and the parameters' module types."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ._config import HookConfig

__all__ = ["pending", "set_pending"]


@dataclass
class _Pending:
    config: HookConfig
    module_types: dict[int, str] = field(default_factory=dict)


_LOCAL = threading.local()


def pending() -> _Pending | None:
    return getattr(_LOCAL, "pending", None)


def set_pending(value: _Pending | None) -> None:
    _LOCAL.pending = value
