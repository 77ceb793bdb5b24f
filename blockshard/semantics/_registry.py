"""The block-semantics registry: ``@register_semantics``, lookup by name, entry-point autoload.

A semantics string is ``NAME`` or ``NAME:ARG[:ARG...]`` with integer arguments (``shampoo:1024``). A
registered object is a :class:`BlockSemantics` subclass whose constructor takes those
arguments. Third-party packages register through the entry-point group
``blockshard.block_semantics``: each entry point names a ``BlockSemantics`` subclass (registered
under the entry point's name) or a module that registers on import. Entry points load on the
first lookup; ``BLOCKSHARD_NO_ENTRY_POINTS=1`` turns that off (``1/true/yes/on`` turn it off,
``0/false/no/off`` or empty leave it on; any other value is an error). A plugin may not take a
name that is already registered (a built-in's, or another plugin's): that raises naming both.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import TypeVar

from blockshard._errors import SemanticsError
from blockshard.semantics._base import BlockSemantics

# The names of the presets (_presets.py, which checks they agree): rules, not one semantics, so
# get_semantics names them in its error.
PRESET_NAMES = frozenset({"muon", "adamw"})

__all__ = [
    "ENTRY_POINT_GROUP",
    "NO_ENTRY_POINTS_ENV",
    "entry_points_disabled",
    "get_semantics",
    "register_semantics",
    "registered_semantics",
    "unregister_semantics",
]

ENTRY_POINT_GROUP = "blockshard.block_semantics"
NO_ENTRY_POINTS_ENV = "BLOCKSHARD_NO_ENTRY_POINTS"

_T = TypeVar("_T", bound=type[BlockSemantics])
_REGISTRY: dict[str, type[BlockSemantics]] = {}
_LOCK = threading.Lock()
_LOAD_LOCK = threading.RLock()
# Set only once every entry point has loaded: a broken plugin raises on every lookup, not just the first.
_entry_points_loaded = False
_entry_points_loading = False  # a plugin's import is looking up semantics: it sees what is registered so far


def register_semantics(name: str, *, replace: bool = False) -> Callable[[_T], _T]:
    """Class decorator: register a :class:`BlockSemantics` subclass under ``name``.

    Example::

        @blockshard.register_semantics("tile64")
        class Tile64(blockshard.BlockSemantics):
            def grid(self, shape, dtype, *, tensor="<tensor>"):
                return blockshard.UnitGrid.units(math.prod(shape), 64)
    """
    if not isinstance(name, str) or not name or ":" in name or "=" in name or "," in name:
        raise SemanticsError(f"register_semantics(name={name!r}): a name is a non-empty string without ':', '=' or ','")

    def decorator(cls: _T) -> _T:
        if not (isinstance(cls, type) and issubclass(cls, BlockSemantics)):
            raise SemanticsError(
                f"register_semantics({name!r}) decorates {cls!r}, which is not a BlockSemantics "
                "subclass; subclass blockshard.BlockSemantics and implement grid()"
            )
        with _LOCK:
            if name in _REGISTRY and _REGISTRY[name] is not cls and not replace:
                raise SemanticsError(
                    f"semantics name {name!r} is already registered to {_REGISTRY[name].__qualname__}; "
                    "pick another name or pass replace=True"
                )
            cls._registered_name = name
            _REGISTRY[name] = cls
        return cls

    return decorator


def unregister_semantics(name: str) -> None:
    with _LOCK:
        _REGISTRY.pop(name, None)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def entry_points_disabled() -> bool:
    """Whether ``BLOCKSHARD_NO_ENTRY_POINTS`` turns plugins off; a value that is not a boolean raises."""
    raw = os.environ.get(NO_ENTRY_POINTS_ENV, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SemanticsError(
        f"environment variable {NO_ENTRY_POINTS_ENV}={raw!r} is not a boolean; set it to 1 (or true, yes, on) "
        "to skip plugins, or to 0 (or false, no, off, empty) to load them"
    )


def _load_entry_points() -> None:
    global _entry_points_loaded, _entry_points_loading
    if _entry_points_loaded or entry_points_disabled():
        return
    with _LOAD_LOCK:
        if _entry_points_loaded or _entry_points_loading:
            return
        _entry_points_loading = True
        try:
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                _load_entry_point(ep)
            _entry_points_loaded = True
        finally:
            _entry_points_loading = False


def _load_entry_point(ep: EntryPoint) -> None:
    try:
        obj = ep.load()
    except Exception as exc:  # a broken plugin must say which one it is
        raise SemanticsError(
            f"entry point {ep.name!r} = {ep.value!r} in group {ENTRY_POINT_GROUP!r} failed to "
            f"load: {exc!r}. Fix or uninstall that package, or set {NO_ENTRY_POINTS_ENV}=1 to skip plugins"
        ) from exc
    if not (isinstance(obj, type) and issubclass(obj, BlockSemantics)):
        return  # a module that registers its semantics on import
    taken = _REGISTRY.get(ep.name)
    if taken is not None and taken is not obj:
        raise SemanticsError(
            f"entry point {ep.name!r} = {ep.value!r}{_dist_of(ep)} in group {ENTRY_POINT_GROUP!r} registers "
            f"{obj.__qualname__} under the name {ep.name!r}, which {taken.__module__}.{taken.__qualname__} "
            f"already has; rename that entry point, or uninstall the plugin (or set {NO_ENTRY_POINTS_ENV}=1 to "
            "skip plugins)"
        )
    register_semantics(ep.name)(obj)


def _dist_of(ep: EntryPoint) -> str:
    name = getattr(getattr(ep, "dist", None), "name", None)  # no dist: not read from an installed package
    return f" (package {name!r})" if name else ""


def reload_entry_points() -> None:
    """Scan the entry-point group again (after installing a plugin in a running process)."""
    global _entry_points_loaded
    _entry_points_loaded = False
    _load_entry_points()


def registered_semantics() -> list[str]:
    """Names of every registered semantics (built-ins, decorated classes and entry points)."""
    _load_entry_points()
    return sorted(_REGISTRY)


def get_semantics(spec: str | BlockSemantics) -> BlockSemantics:
    """Look up ``spec`` (``"nf4"``, ``"shampoo:1024"``) and return a semantics instance."""
    if isinstance(spec, BlockSemantics):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise SemanticsError(f"semantics={spec!r} must be a name such as 'nf4' or 'shampoo:1024', or a BlockSemantics")
    name, *raw_args = spec.strip().split(":")
    _load_entry_points()
    cls = _REGISTRY.get(name)
    if cls is None:
        hint = f" ({name!r} is a preset of rules: use it where rules are accepted)" if name in PRESET_NAMES else ""
        raise SemanticsError(
            f"unknown semantics {name!r}{hint}; registered: {', '.join(registered_semantics())}. "
            "Register your own with @blockshard.register_semantics(name)"
        )
    try:
        args = [int(a) for a in raw_args]
    except ValueError:
        raise SemanticsError(
            f"semantics {spec!r}: arguments {raw_args} must be integers (e.g. 'shampoo:1024')"
        ) from None
    try:
        sem = cls(*args)
    except TypeError as exc:
        raise SemanticsError(f"semantics {spec!r}: wrong number of arguments for {name!r} ({exc})") from None
    sem.spec = spec.strip()
    return sem
