"""The route of ``torch.nn.utils.clip_grad_norm_`` to :func:`blockshard.clip_grad_norm_` on sharded
pieces ([Note: clipping] in core/_clip.py, [Note: torch routes] in _route.py).

torch's ``clip_grad_norm_`` is a ``no_grad`` wrapper (``_no_grad`` in ``torch/nn/utils/clip_grad.py``)
whose one closure cell, ``func``, holds the implementation. The route puts a function in that cell
that calls blockshard's clipping when any parameter is a sharded piece and torch's implementation
otherwise, so every reference to torch's function object is routed, however early it was bound
(``from torch.nn.utils import clip_grad_norm_`` at the top of a script). Undone by putting torch's
implementation back in the cell.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from blockshard.runtime.core._clip import clip_grad_norm_
from blockshard.runtime.core._param import managed_tag
from blockshard.runtime.routes._route import Route, signature_problem

__all__ = ["CLIP_ROUTE"]

_PARAMETERS = ("parameters", "max_norm", "norm_type", "error_if_nonfinite", "foreach")


def _cell() -> Any:
    import torch.nn.utils.clip_grad as torch_clip

    fn = torch_clip.clip_grad_norm_
    if getattr(getattr(fn, "__code__", None), "co_freevars", ()) != ("func",) or not fn.__closure__:
        return None
    return fn.__closure__[0]


def _check() -> list[str]:
    import torch.nn.utils.clip_grad as torch_clip

    if torch.nn.utils.clip_grad_norm_ is not torch_clip.clip_grad_norm_:
        return ["torch.nn.utils.clip_grad_norm_ is not torch.nn.utils.clip_grad.clip_grad_norm_ (replaced by someone)"]
    cell = _cell()
    if cell is None:
        return ["clip_grad_norm_ is not a no_grad wrapper holding its implementation in one closure cell 'func'"]
    return signature_problem("clip_grad_norm_'s implementation", cell.cell_contents, _PARAMETERS)


def _install() -> Callable[[], None]:
    cell = _cell()
    torch_impl: Callable[..., torch.Tensor] = cell.cell_contents

    @functools.wraps(torch_impl)
    def clip_grad_norm_routed(
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if any(isinstance(p, nn.Parameter) and managed_tag(p) is not None for p in params):
            return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
        return torch_impl(params, max_norm, norm_type, error_if_nonfinite, foreach)

    cell.cell_contents = clip_grad_norm_routed

    def undo() -> None:
        cell.cell_contents = torch_impl

    return undo


CLIP_ROUTE = Route(
    name="clip_grad_norm_",
    replaces="torch.nn.utils.clip_grad_norm_ (the implementation in its no_grad wrapper)",
    without="torch.nn.utils.clip_grad_norm_ on sharded pieces returns this rank's local norm and every rank clips by "
    "a different factor: call blockshard.clip_grad_norm_(model, max_norm) instead",
    check=_check,
    install=_install,
)
