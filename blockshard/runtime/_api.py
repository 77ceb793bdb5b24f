"""``blockshard.fully_shard``: FSDP2's user surface on ragged, block-aligned layouts."""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from blockshard._errors import BlockshardError
from blockshard.planner import GroupLayout, PlanItem, plan_group, resolve_items
from blockshard.planner._balance import balance
from blockshard.runtime._collectives import check_same_layout
from blockshard.runtime._group import ParamGroup
from blockshard.runtime._param import ParamRef, ShardedParam
from blockshard.runtime._state import ShardState, register_hooks
from blockshard.semantics import BlockSemantics, SemanticsRules, TensorSpec

__all__ = [
    "ShardedModule",
    "ShardingError",
    "fully_shard",
    "group_layouts",
    "is_sharded",
    "local_buffers",
]

_STATES: weakref.WeakKeyDictionary[nn.Module, ShardState] = weakref.WeakKeyDictionary()
# [Note: cost tally]
# Optimizer cost per rank of the groups sharded so far, per process group (see [Note: rotation]
# in planner/_balance.py): every rank makes the same fully_shard calls in the same order, so every
# rank rotates the same way. The tally belongs to one model: it restarts after a call that shards
# a module containing every module tallied so far (the root, sharded last), so a second model
# built in the same process gets the same layouts as the first.
_TALLY: dict[int, tuple[np.ndarray, list[weakref.ref]]] = {}


def _balanced(layout: GroupLayout | None, items: list[PlanItem], module: nn.Module, pg: dist.ProcessGroup):
    running, tallied = _TALLY.setdefault(id(pg), (np.zeros(pg.size()), []))
    if layout is not None:
        layout = balance(layout, {it.name: it.cost for it in items}, running)
    inside = {id(m) for m in module.modules()}
    alive = [ref() for ref in tallied if ref() is not None]
    if alive and all(id(m) in inside for m in alive):
        del _TALLY[id(pg)]  # ``module`` contains everything tallied: it is this model's root
    else:
        tallied.append(weakref.ref(module))
    return layout


# Parameter objects the engine made (sharded and unsharded) and the original parameters it
# replaced, by id (tensors compare by value, so they cannot be dictionary keys): a weak reference,
# the owning module's class name, and whether it is an original.
_MANAGED: dict[int, tuple[weakref.ref, str, bool]] = {}


def _managed_by(p: nn.Parameter) -> tuple[str, bool] | None:
    hit = _MANAGED.get(id(p))
    return (hit[1], hit[2]) if hit is not None and hit[0]() is p else None


def _manage(p: nn.Parameter, owner: str, *, original: bool = False) -> None:
    key = id(p)
    _MANAGED[key] = (weakref.ref(p, lambda _ref: _MANAGED.pop(key, None)), owner, original)


class ShardingError(BlockshardError):
    """``fully_shard`` was used in a way the engine does not support (with the fix in the message)."""


@runtime_checkable
class ShardedModule(Protocol):
    """What ``fully_shard`` adds to a module (as FSDP2's ``FSDPModule``)."""

    def unshard(self) -> None: ...
    def reshard(self) -> None: ...
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None: ...


def is_sharded(module: nn.Module) -> bool:
    return module in _STATES


def _state_of(module: nn.Module) -> ShardState | None:
    return _STATES.get(module)


def _process_group(mesh) -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise ShardingError(
            "fully_shard needs an initialized process group: call torch.distributed.init_process_group "
            "(backend 'gloo' on CPU, 'nccl' on GPUs) first, e.g. under torchrun"
        )
    if mesh is None:
        return dist.group.WORLD
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ShardingError(
                f"mesh has {mesh.ndim} dims {mesh.mesh_dim_names}; blockshard shards over a 1-D mesh. "
                "Pass the sharding axis, e.g. mesh['dp_shard']"
            )
        return mesh.get_group()
    raise ShardingError(f"mesh={mesh!r} must be None, a 1-D DeviceMesh or a ProcessGroup")


def _collect(module: nn.Module) -> tuple[list[str], list[nn.Parameter], list[list[ParamRef]]]:
    """Parameters of ``module``'s subtree not owned by an already sharded submodule."""
    names: list[str] = []
    params: list[nn.Parameter] = []
    refs: dict[int, list[ParamRef]] = {}
    owned_below: dict[int, str] = {}
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        prefix, mod = stack.pop()
        if mod is not module and is_sharded(mod):
            for n, p in mod.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
                owned_below[id(p)] = n
            continue
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            if id(p) not in refs:
                names.append(prefix + attr)
                params.append(p)
                refs[id(p)] = []
            refs[id(p)].append(ParamRef(mod, attr))
        children = list(mod._modules.items())
        for cname, child in reversed(children):
            if child is not None:
                stack.append((f"{prefix}{cname}.", child))
    shared = [(n, owned_below[id(p)]) for n, p in zip(names, params, strict=True) if id(p) in owned_below]
    if shared:
        raise ShardingError(
            f"parameters shared between this group and an already sharded submodule: {shared[:5]}. One "
            "parameter can live in one group only. Fix: shard the modules that share it in one "
            "fully_shard call (e.g. leave the tied head and embedding to the root), or untie them"
        )
    return names, params, [refs[id(p)] for p in params]


def _check_params(names: list[str], params: list[nn.Parameter]) -> None:
    for n, p in zip(names, params, strict=True):
        hit = _managed_by(p)
        if hit is not None and hit[1]:
            raise ShardingError(
                f"parameter {n!r} is shared with a module already sharded in another group (a {hit[0]}); one "
                "parameter can live in one group only. Fix: shard the modules that share it in one "
                "fully_shard call (e.g. leave tied embeddings and head to the root), or untie them"
            )
        if hit is not None:
            raise ShardingError(
                f"parameter {n!r} already belongs to a sharded group (of a {hit[0]}): fully_shard "
                "was applied top-down. Fix: apply it bottom-up — layers first, then the root"
            )
        if not p.is_contiguous():
            raise ShardingError(
                f"parameter {n!r} of shape {tuple(p.shape)} is not contiguous (strides {p.stride()}); the "
                "engine shards the row-major flattening. Fix: make it contiguous first, e.g. "
                "module.weight = nn.Parameter(module.weight.contiguous())"
            )
        if p.device.type == "meta":
            raise ShardingError(f"parameter {n!r} is on the meta device; materialize the model before fully_shard")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ShardingError(
            f"the group's parameters are on several devices {sorted(map(str, devices))}; move the module to one device first"
        )


def _rules(semantics, params_by_name: Mapping[str, nn.Parameter]) -> object:
    """``semantics`` as fully_shard takes it; a plain callable gets ``(name, param)``."""
    if callable(semantics) and not isinstance(semantics, (BlockSemantics, SemanticsRules, type)):
        user: Callable = semantics
        return SemanticsRules.coerce(lambda name, _spec: user(name, params_by_name[name]))
    return semantics


def fully_shard(
    module: nn.Module,
    *,
    mesh=None,
    reshard_after_forward: bool = True,
    mp_policy=None,
    semantics: object = None,
    alignment: int = 16,
) -> nn.Module:
    """Shard ``module``'s parameters (those not in an already sharded submodule) as one group.

    Apply bottom-up as with FSDP2: layers first, then the root. ``semantics`` gives each
    parameter its block semantics: a mapping ``glob -> semantics`` on parameter names relative to
    ``module``, a callable ``(name, param) -> semantics | None``, a spec string or rules
    (default: ``elementwise``). ``alignment`` is in bytes: every bucket's per-rank segment is a
    multiple of it (16 suits vectorized kernels and NCCL). ``mp_policy`` is torch's ``MixedPrecisionPolicy`` (``param_dtype``,
    ``reduce_dtype``, ``output_dtype``, ``cast_forward_inputs``). Returns ``module``, which gains
    ``unshard()``, ``reshard()`` and ``set_requires_gradient_sync()``.
    """
    if not isinstance(module, nn.Module):
        raise ShardingError(f"module={module!r} must be a torch.nn.Module")
    if is_sharded(module):
        raise ShardingError(
            f"this {type(module).__name__} is already sharded: call fully_shard once per module "
            "(bottom-up: layers first, then the root)"
        )
    pg = _process_group(mesh)
    names, params, refs = _collect(module)
    _check_params(names, params)
    name = type(module).__name__
    layout: GroupLayout | None = None
    if params:  # a root without parameters of its own still drives the hooks, as in FSDP2
        by_name = dict(zip(names, params, strict=True))
        specs = [
            TensorSpec(name=n, shape=tuple(p.shape), dtype=p.dtype, module_type=_owner_type(r))
            for n, p, r in zip(names, params, refs, strict=True)
        ]
        items: list[PlanItem] = resolve_items(specs, _rules(semantics, by_name))
        layout = plan_group(items, pg.size(), name=name, alignment_bytes=alignment)
    layout = _balanced(layout, items if params else [], module, pg)
    check_same_layout(name, layout.layout_hash() if layout else "empty", pg)
    index = {t.name: i for i, t in enumerate(layout.tensors)} if layout else {}
    sps = [
        ShardedParam(fqn=n, refs=r, shape=tuple(p.shape), requires_grad=p.requires_grad, index=index[n])
        for n, p, r in zip(names, params, refs, strict=True)
    ]
    group = ParamGroup(
        name, sps, params, layout, pg,
        param_dtype=getattr(mp_policy, "param_dtype", None),
        reduce_dtype=getattr(mp_policy, "reduce_dtype", None),
    )  # fmt: skip
    state = ShardState(
        module, group, reshard_after_forward,
        param_dtype=getattr(mp_policy, "param_dtype", None),
        output_dtype=getattr(mp_policy, "output_dtype", None),
        cast_forward_inputs=getattr(mp_policy, "cast_forward_inputs", True),
    )  # fmt: skip
    _STATES[module] = state
    for sp, orig in zip(sps, params, strict=True):
        _manage(sp.sharded, name)
        _manage(sp.unsharded, name)
        _manage(orig, name, original=True)
    state.handles = register_hooks(state, _state_of)
    _bind_methods(module, state)
    return module


def _owner_type(refs: list[ParamRef]) -> str:
    return type(refs[0].module).__name__


def _bind_methods(module: nn.Module, state: ShardState) -> None:
    def unshard(self) -> None:
        state.group.unshard()

    def reshard(self) -> None:
        state.group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        mods = self.modules() if recurse else [self]
        for m in mods:
            st = _state_of(m)
            if st is not None:
                st.group.requires_gradient_sync = requires_gradient_sync

    for fn in (unshard, reshard, set_requires_gradient_sync):
        object.__setattr__(module, fn.__name__, types.MethodType(fn, module))


# -- inspection and state dicts ---------------------------------------------------------------
def _states_under(model: nn.Module) -> list[tuple[str, ShardState]]:
    return [(prefix, st) for prefix, m in model.named_modules() if (st := _state_of(m)) is not None]


def group_layouts(model: nn.Module) -> dict[str, GroupLayout]:
    """The layout of every group under ``model``, by the sharded module's name."""
    return {prefix: st.group.layout for prefix, st in _states_under(model) if st.group.layout is not None}


def local_buffers(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """The persistent buffers of every group (``local`` and ``grad``), for memory checks."""
    return {
        prefix: {"local": st.group.local, "grad": st.group.grad}
        for prefix, st in _states_under(model)
        if st.group.layout is not None
    }


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
