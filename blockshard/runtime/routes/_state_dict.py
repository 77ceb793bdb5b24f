"""The route of ``torch.distributed.checkpoint.state_dict`` (``get_state_dict``, ``set_state_dict``,
``get_optimizer_state_dict``, ...) for blockshard models ([Note: torch routes] in _route.py).

[Note: torch's state-dict helpers]
``torch.distributed.checkpoint.state_dict`` (torch 2.13 and 2.14) gathers only the sharded types
it knows (``_gather_state_dict`` dispatches on ``isinstance(x, DTensor | ShardedTensor)``; any
other tensor passes through), and maps optimizer state to names through
``optimizer.state_dict()``'s integer ids, keeping each rank's local tensors. For FSDP2 that is
right (parameters and state are DTensors); for a blockshard model it returned PieceTensors under
``full_state_dict=True`` and per-rank pieces as the optimizer's state. Nothing in torch lets
another sharded type take part (no registry; the checks are on exact classes), so the route wraps
four of the module's private functions, each of which keeps torch's own behaviour for every model
that holds no blockshard group (the wrapper's first test):

* ``_get_model_state_dict``: under ``full_state_dict=True``, torch's sharded state dict with each
  PieceTensor gathered to its full tensor (``gather_pieces`` in checkpoint/_state_dict.py, one
  tensor at a time, dropped on the ranks ``cpu_offload`` leaves empty, tied names sharing one
  tensor), the quantized weights' entries whole again, then torch's own offload and rank-0-only
  handling (``_maybe_full_or_cpu_state_dict``);
* ``_get_optim_state_dict`` / ``_load_optim_state_dict``: blockshard's
  :func:`~blockshard.runtime.optimizer_state_dict` (FQN-keyed, PieceTensor entries that DCP
  reshards; gathered likewise under ``full_state_dict=True``) and its loader, which also takes
  full tensors (each rank copies its piece out), torch's flattened form and rank 0's broadcast
  (_torch_optim_state.py);
* ``_get_fqns``: a quantized tensor's entries (``weight.absmax``,
  ``weight.quant_state.bitsandbytes__nf4``) name no attribute of the sharded piece; a name that
  fails where it reaches a tensor keeps the rest as it is ([Note: quantized state dicts]).

The check reads the signatures of these functions and of ``_maybe_full_or_cpu_state_dict``, and
the fields of ``_StateDictInfo`` the wrappers read. Loading a model needs no wrapper: torch hands
``model.load_state_dict`` full tensors or the PieceTensors, which blockshard's load pre-hook turns
into this rank's piece.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from blockshard.runtime.checkpoint._quantized_state import full_entries_of
from blockshard.runtime.checkpoint._state_dict import gather_pieces
from blockshard.runtime.core._inspect import states_under
from blockshard.runtime.routes._route import Route, signature_problem
from blockshard.runtime.routes._torch_optim_state import torch_load_optimizer_state_dict, torch_optimizer_state_dict

__all__ = ["STATE_DICT_ROUTE"]

_SIGNATURES = {
    "_get_model_state_dict": ("model", "info"),
    "_get_optim_state_dict": ("model", "optimizers", "info"),
    "_load_optim_state_dict": ("model", "optimizers", "state_dict", "info"),
    "_get_fqns": ("model", "name"),
    "_maybe_full_or_cpu_state_dict": ("state_dict", "info"),
}
_INFO_FIELDS = ("full_state_dict", "cpu_offload", "handle_optim")


def _dsd() -> Any:
    import torch.distributed.checkpoint.state_dict as dsd

    return dsd


def _check() -> list[str]:
    dsd = _dsd()
    problems = [
        p for name, params in _SIGNATURES.items() for p in signature_problem(name, getattr(dsd, name, None), params)
    ]
    info = getattr(dsd, "_StateDictInfo", None)
    fields = {f.name for f in dataclasses.fields(info)} if dataclasses.is_dataclass(info) else set()
    missing = [f for f in _INFO_FIELDS if f not in fields]
    if missing:
        problems.append(f"_StateDictInfo has no field {missing}")
    return problems


def _keeps(info: Any) -> bool:
    """Whether this rank keeps gathered values: ``cpu_offload`` with ``full_state_dict`` leaves them
    on rank 0 only, as torch does for DTensors."""
    import torch.distributed as dist

    return not (info.full_state_dict and info.cpu_offload and dist.is_initialized() and dist.get_rank() != 0)


def _install() -> Callable[[], None]:
    dsd = _dsd()
    originals = {name: getattr(dsd, name) for name in ("_get_model_state_dict", "_get_optim_state_dict")}
    originals |= {name: getattr(dsd, name) for name in ("_load_optim_state_dict", "_get_fqns")}
    get_model: Callable[[nn.Module, Any], dict[str, Any]]
    get_optim: Callable[[nn.Module, tuple[torch.optim.Optimizer, ...], Any], dict[str, Any]]
    load_optim: Callable[[nn.Module, tuple[torch.optim.Optimizer, ...], dict[str, Any], Any], None]
    get_model, get_optim = originals["_get_model_state_dict"], originals["_get_optim_state_dict"]
    load_optim, get_fqns = originals["_load_optim_state_dict"], originals["_get_fqns"]

    @functools.wraps(get_model)
    def _get_model_state_dict(model: nn.Module, info: Any) -> dict[str, Any]:
        if not states_under(model) or not info.full_state_dict:
            return get_model(model, info)
        state = get_model(model, dataclasses.replace(info, full_state_dict=False, cpu_offload=False))
        state = full_entries_of(model, gather_pieces(state, keep=_keeps(info)), states_under(model))  # quantized
        full: dict[str, Any] = dsd._maybe_full_or_cpu_state_dict(state, info)
        return full

    @functools.wraps(get_optim)
    def _get_optim_state_dict(
        model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], info: Any
    ) -> dict[str, Any]:
        if not states_under(model) or not info.handle_optim:
            return get_optim(model, optimizers, info)
        return torch_optimizer_state_dict(model, optimizers, info, keep=_keeps(info))

    @functools.wraps(load_optim)
    def _load_optim_state_dict(
        model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], state_dict: dict[str, Any], info: Any
    ) -> None:
        if not states_under(model) or not info.handle_optim:
            return load_optim(model, optimizers, state_dict, info)
        return torch_load_optimizer_state_dict(model, optimizers, state_dict, info)

    @functools.wraps(get_fqns)
    def _get_fqns(model: nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return get_fqns(model, name, *args, **kwargs)
        except AttributeError:
            parts, obj = name.split("."), cast(Any, model)
            for i, part in enumerate(parts):
                if isinstance(obj, torch.Tensor) and i > 0:
                    rest = ".".join(parts[i:])
                    return {f"{f}.{rest}" for f in get_fqns(model, ".".join(parts[:i]), *args, **kwargs)}
                obj = getattr(obj, part, None)
            raise

    for wrapper in (_get_model_state_dict, _get_optim_state_dict, _load_optim_state_dict, _get_fqns):
        setattr(dsd, wrapper.__name__, wrapper)

    def undo() -> None:
        for name, fn in originals.items():
            setattr(dsd, name, fn)

    return undo


STATE_DICT_ROUTE = Route(
    name="state_dict",
    replaces="torch.distributed.checkpoint.state_dict's _get_model_state_dict, _get_optim_state_dict, "
    "_load_optim_state_dict and _get_fqns",
    without="get_state_dict / get_model_state_dict(full_state_dict=True) return per-rank pieces and "
    "get_optimizer_state_dict / set_optimizer_state_dict per-rank state: use blockshard.full_state_dict, "
    "blockshard.sharded_state_dict, blockshard.optimizer_state_dict and blockshard.load_optimizer_state_dict instead",
    check=_check,
    install=_install,
)
