"""The route of FSDP2's ``register_fsdp_forward_method`` to :func:`blockshard.register_forward_method`
on a blockshard module ([Note: torch routes] in _route.py).

torch's function returns without doing anything for a module that is not an ``FSDPModule``, so
``generate`` (or any method called instead of ``forward``) would run on the local pieces. The
route replaces the function's code object by a call to a route kept in torch's module namespace,
so every reference to torch's function object is routed, including ``from torch.distributed.fsdp
import register_fsdp_forward_method`` bound before the first ``fully_shard``. The route calls
blockshard's for a blockshard module and torch's original code otherwise. Undone by putting the
original code object back and removing the name.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from torch import nn

from blockshard.runtime.core._module import register_forward_method
from blockshard.runtime.core._state import state_of
from blockshard.runtime.routes._route import Route, signature_problem

__all__ = ["FORWARD_METHOD_ROUTE"]

_ROUTE_NAME = "_blockshard_forward_method_route"


def _impl() -> Any:
    import torch.distributed.fsdp._fully_shard._fully_shard as fsdp_impl

    return fsdp_impl


def _check() -> list[str]:
    import torch.distributed.fsdp as fsdp

    impl = _impl()
    fn = getattr(impl, "register_fsdp_forward_method", None)
    if not isinstance(fn, types.FunctionType):
        return [f"torch.distributed.fsdp._fully_shard._fully_shard.register_fsdp_forward_method is {type(fn).__name__}"]
    problems = signature_problem("register_fsdp_forward_method", fn, ("module", "method_name"))
    if fn.__closure__ is not None or fn.__code__.co_freevars:
        problems.append("register_fsdp_forward_method is a closure (its code cannot be swapped)")
    if getattr(fsdp, "register_fsdp_forward_method", None) is not fn:
        problems.append("torch.distributed.fsdp.register_fsdp_forward_method is another object than the one defined")
    if _ROUTE_NAME in vars(impl):
        problems.append(f"torch's module already holds a name {_ROUTE_NAME!r}")
    return problems


def _install() -> Callable[[], None]:
    impl = _impl()
    fn = impl.register_fsdp_forward_method
    original = fn.__code__
    torch_code: Callable[[nn.Module, str], None] = types.FunctionType(
        original, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )

    def route(module: nn.Module, method_name: str) -> None:
        if state_of(module) is not None:
            return register_forward_method(module, method_name)
        return torch_code(module, method_name)

    vars(impl)[_ROUTE_NAME] = route
    fn.__code__ = _routed.__code__

    def undo() -> None:
        fn.__code__ = original
        vars(impl).pop(_ROUTE_NAME, None)

    return undo


def _routed(module: nn.Module, method_name: str) -> None:
    """The code torch's ``register_fsdp_forward_method`` runs once routed: the name resolves in
    torch's module namespace, where the route was put."""
    return _blockshard_forward_method_route(module, method_name)  # type: ignore[name-defined,no-any-return] # noqa: F821


FORWARD_METHOD_ROUTE = Route(
    name="register_fsdp_forward_method",
    replaces="torch.distributed.fsdp.register_fsdp_forward_method (its code object)",
    without="torch's register_fsdp_forward_method does nothing for a blockshard module, so the method runs on the "
    "local pieces: call blockshard.register_forward_method(module, name) instead",
    check=_check,
    install=_install,
)
