"""The torch routes: every place blockshard changes a torch function (or peft's
``PeftModel.save_pretrained``), each checked against the installed release, switchable and
undoable ([Note: torch routes] in _route.py).

``fully_shard`` calls :func:`install_torch_routes`; ``BLOCKSHARD_TORCH_ROUTES`` chooses which
(unset or ``all``: every route; ``none``: none; else a comma list of route names);
:func:`uninstall_torch_routes` puts torch's functions back. Imports the layers below it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch

from blockshard._errors import TorchRouteError
from blockshard.runtime.routes._clip import CLIP_ROUTE
from blockshard.runtime.routes._forward_method import FORWARD_METHOD_ROUTE
from blockshard.runtime.routes._peft import PEFT_ROUTE
from blockshard.runtime.routes._route import Route
from blockshard.runtime.routes._state_dict import STATE_DICT_ROUTE

__all__ = [
    "ROUTES",
    "ROUTES_ENV",
    "TESTED_TORCH",
    "Route",
    "enabled_torch_routes",
    "install_torch_routes",
    "installed_torch_routes",
    "uninstall_torch_routes",
]

ROUTES: tuple[Route, ...] = (CLIP_ROUTE, FORWARD_METHOD_ROUTE, STATE_DICT_ROUTE, PEFT_ROUTE)
ROUTES_ENV = "BLOCKSHARD_TORCH_ROUTES"
TESTED_TORCH = ("2.13", "2.14")  # the releases the suite runs on (pyproject.toml: torch>=2.13,<2.15)

# route name -> its undo. Process-wide, as the torch functions the routes change are (ranks on
# threads share them); changed only under the lock.
_installed: dict[str, Callable[[], None]] = {}
_LOCK = threading.Lock()


def enabled_torch_routes() -> tuple[Route, ...]:
    """The routes ``BLOCKSHARD_TORCH_ROUTES`` keeps (all when it is unset)."""
    raw = os.environ.get(ROUTES_ENV, "all").strip()
    if raw.lower() in ("", "all", "1", "on"):
        return ROUTES
    if raw.lower() in ("none", "0", "off"):
        return ()
    names = [n.strip() for n in raw.split(",") if n.strip()]
    by_name = {r.name: r for r in ROUTES}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise TorchRouteError(
            f"{ROUTES_ENV}={raw!r} names {unknown}, which are no routes; the routes are {sorted(by_name)}. Fix: set "
            f"it to 'all', 'none' or a comma list of those names"
        )
    return tuple(r for r in ROUTES if r.name in names)


def install_torch_routes() -> tuple[str, ...]:
    """Check and install every enabled route that applies and is not installed yet (idempotent,
    thread-safe); a route whose object differs from what it was written for raises
    :class:`TorchRouteError` and changes nothing. Returns the names installed now."""
    routes = enabled_torch_routes()
    with _LOCK:
        todo = [r for r in routes if r.name not in _installed and r.applies()]
        for route in todo:
            problems = route.check()
            if problems:
                lib, tested = route.library, route.tested or TESTED_TORCH
                raise TorchRouteError(
                    f"blockshard's torch route {route.name!r} ({route.replaces}) does not fit {lib} "
                    f"{_version(lib)}: {'; '.join(problems)}. blockshard is tested on {lib} "
                    f"{' and '.join(tested)}. Fix: install a tested {lib}, or set {ROUTES_ENV} to the routes "
                    f"to keep (e.g. {ROUTES_ENV}=none) and do without this one: {route.without}"
                )
        for route in todo:
            _installed[route.name] = route.install()
    return tuple(r.name for r in todo)


def _version(library: str) -> str:
    if library == "torch":
        return str(torch.__version__)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(library)
    except PackageNotFoundError:
        return "(not installed)"


def uninstall_torch_routes() -> tuple[str, ...]:
    """Undo every installed route, newest first; torch's functions are its own again. Returns the
    names undone. The next ``fully_shard`` installs the enabled routes again."""
    with _LOCK:
        names = tuple(reversed(_installed))
        for name in names:
            _installed.pop(name)()
    return names


def installed_torch_routes() -> tuple[str, ...]:
    """The names of the routes installed now, in installation order."""
    return tuple(_installed)
