"""One torch route: what it replaces, how its shape is checked, how it is installed and undone.

[Note: torch routes]
Some user code reaches torch directly, and on a blockshard model torch's answer would be silently
wrong: ``torch.nn.utils.clip_grad_norm_`` returns the norm of this rank's pieces
([Note: clipping] in core/_clip.py), FSDP2's ``register_fsdp_forward_method`` does nothing for a
module that is not an ``FSDPModule``, and ``torch.distributed.checkpoint.state_dict``'s
``get_state_dict`` / ``set_state_dict`` know only DTensors ([Note: torch's state-dict helpers] in
_state_dict.py). blockshard changes these torch functions in one place, this package, and only
through :func:`~blockshard.runtime.routes.install_torch_routes`, which ``fully_shard`` calls:

* each :class:`Route` first **checks the shape** of what it replaces on the installed torch (the
  signatures, the closure cell or code object it swaps, the attributes it reads); anything else
  raises :class:`~blockshard.TorchRouteError` naming the route, what differs and the torch
  version, never a silent fallback;
* routes can be **turned off** by the environment variable ``BLOCKSHARD_TORCH_ROUTES`` (``none``,
  or a comma list of the routes to keep); ``Route.without`` says what is lost then and the explicit
  call to make instead (``blockshard.clip_grad_norm_``, ``blockshard.register_forward_method``,
  ``blockshard.full_state_dict`` / ``optimizer_state_dict``);
* routes can be **undone**: ``install`` returns the undo, and
  :func:`~blockshard.runtime.routes.uninstall_torch_routes` runs them, leaving torch's functions
  as they were (tests/runtime/test_fast_routes.py checks the objects are torch's own again).

A route may change a library on top of torch (``Route.library``): the peft route (_peft.py)
wraps ``PeftModel.save_pretrained``. Such a route applies only once its library is imported
(``Route.applies``; importing peft takes seconds, so ``fully_shard`` never imports it): each
``fully_shard`` installs the routes that apply by then.

Every route keeps torch's own behaviour for everything that is not a blockshard model. The
installed set is process-wide state, because the torch functions it changes are: ranks on threads
share one interpreter and one torch, so installing is idempotent and under a lock.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Route", "parameter_names", "signature_problem"]


def _always() -> bool:
    return True


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """A change blockshard makes to torch (or to a library on top of it, ``library``), with its
    check and its undo."""

    name: str  # what BLOCKSHARD_TORCH_ROUTES names
    replaces: str  # the object it changes, for messages
    without: str  # what a user loses with it off, and the explicit call to make instead
    check: Callable[[], list[str]]  # what differs from the release this route was written for; [] if it fits
    install: Callable[[], Callable[[], None]]  # changes the library; returns the undo
    library: str = "torch"  # the distribution whose object it changes (its version goes into messages)
    tested: tuple[str, ...] = ()  # that library's releases the suite runs on (empty: torch's, TESTED_TORCH)
    applies: Callable[[], bool] = _always  # False: not installed now (its library is not imported yet)


def parameter_names(fn: object) -> tuple[str, ...] | None:
    """The names of ``fn``'s parameters (``None`` if it has no signature)."""
    try:
        return tuple(inspect.signature(fn).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def signature_problem(what: str, fn: object, expected: tuple[str, ...]) -> list[str]:
    """``[]`` if ``fn`` is a function whose parameters start with ``expected``, else what differs."""
    if not callable(fn):
        return [f"{what} is missing or not callable ({type(fn).__name__})"]
    names = parameter_names(fn)
    if names is None or names[: len(expected)] != expected:
        return [f"{what} takes {names}, the route was written for {expected}"]
    return []
