"""``blockshard.fully_shard``: FSDP2's user surface on ragged, block-aligned layouts."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from blockshard._errors import BlockshardError
from blockshard.planner import GroupLayout, PlanItem, resolve_items
from blockshard.planner._balance import rotate
from blockshard.planner._policy import check_policy, choose_layout
from blockshard.planner._units import check_alignment_bytes
from blockshard.runtime._clip import install_torch_clip_route
from blockshard.runtime._collectives import check_same_layout, engine_group
from blockshard.runtime._group import ShardGroup
from blockshard.runtime._optim_guard import install_optimizer_guard
from blockshard.runtime._owners import EngineOwnerBuilder, compute_of, plan_owners, qualified_group, record_compute
from blockshard.runtime._param import ParamRef, ShardedParam, managed_tag, tag_managed
from blockshard.runtime._state import STATE_ATTR, ModuleState, state_of
from blockshard.semantics import BlockSemantics, SemanticsRules, TensorSpec
from blockshard.semantics._rules import call_user_semantics

__all__ = [
    "ShardedModule",
    "ShardingError",
    "UnshardHandle",
    "fully_shard",
    "global_shapes",
    "group_layouts",
    "is_sharded",
    "local_buffers",
]


class ShardingError(BlockshardError):
    """``fully_shard`` was used in a way the engine does not support (with the fix in the message)."""


class UnshardHandle:
    """What ``module.unshard(async_op=True)`` returns: ``wait()`` finishes the all-gathers."""

    def __init__(self, group: ShardGroup) -> None:
        self._group = group

    def wait(self) -> None:
        self._group.wait_unshard()


class ShardedModule(nn.Module):
    """What ``fully_shard`` makes of a module (as FSDP2's ``FSDPModule``).

    ``fully_shard(m)`` swaps ``m``'s class for ``BlockShard<Class>``, a subclass of both this class
    and ``m``'s own, so ``isinstance(m, ShardedModule)`` holds and the methods below exist; the
    engine's state lives on the module (``m._blockshard_state``), nowhere else.
    """

    def _bs_state(self) -> ModuleState:
        state = state_of(self)
        if state is None:
            raise ShardingError(f"this {type(self).__name__} has no blockshard state; shard it with fully_shard")
        return state

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (``async_op=True``: return a handle to ``wait()``)."""
        group = self._bs_state().group
        group.unshard(async_op=async_op)
        return UnshardHandle(group) if async_op else None

    def reshard(self) -> None:
        """Free the gathered parameters; the module holds its local pieces again."""
        self._bs_state().group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Off: backward accumulates unsharded gradients without a reduce-scatter (micro-batches)."""
        if not isinstance(requires_gradient_sync, bool):
            raise ShardingError(f"requires_gradient_sync={requires_gradient_sync!r} must be True or False")
        for m in self.modules() if recurse else [self]:
            st = state_of(m)
            if st is not None:
                st.group.requires_gradient_sync = requires_gradient_sync

    def _apply(self, fn: Callable, recurse: bool = True) -> ShardedModule:
        """``.to()``, ``.double()``, ``.cuda()``...: allowed only when they change nothing about the
        parameters (the sharded parameters are views of the engine's buffers; a converted copy
        would be trained while the engine gathers the old buffer)."""
        for m in self.modules():
            st = state_of(m)
            if st is None or st.group.layout is None:
                continue
            probe = st.group.local[:1]
            if fn(probe) is not probe:
                raise ShardingError(
                    f"converting or moving a sharded module (model.to(...), .double(), .half(), .cuda()) "
                    f"would replace the parameters of group {st.group.name!r} ({st.group.orig_dtype} on "
                    f"{st.group.device}) with copies the engine does not own, so training would silently "
                    "ignore them. Fix: convert or move the model before fully_shard, or keep the parameters "
                    "and compute in another dtype with mp_policy=MixedPrecisionPolicy(param_dtype=...)"
                )
        return super()._apply(fn, recurse)

    def __deepcopy__(self, memo: dict) -> NoReturn:
        raise ShardingError(
            f"copy.deepcopy of a sharded {self._bs_state().group.name} is not supported: the copy would share "
            "the original's buffers and collectives (its unshard() would unshard the original). Fix: "
            "deepcopy the model before fully_shard and shard the copy, or build a second model"
        )


# One subclass per original class, as FSDP2's ``FSDP<Class>``: a cache, not state (same inputs
# give the same class).
_SWAPPED: dict[type, type] = {}


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    sharded = _SWAPPED.get(cls)
    if sharded is None:
        sharded = type(f"BlockShard{cls.__name__}", (ShardedModule, cls), {"__module__": cls.__module__})
        _SWAPPED[cls] = sharded
    module.__class__ = sharded


def is_sharded(module: nn.Module) -> bool:
    return state_of(module) is not None


def _state_of(module: nn.Module) -> ModuleState | None:
    return state_of(module)


def _process_group(mesh: object) -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise ShardingError(
            "fully_shard needs an initialized process group: call torch.distributed.init_process_group "
            "(backend 'gloo' on CPU, 'nccl' on GPUs) first, e.g. under torchrun"
        )
    if mesh is None:
        world = dist.group.WORLD
        if world is None:
            raise ShardingError("the default process group is not initialized; call init_process_group first")
        return world
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
        for attr, param in mod._parameters.items():
            if param is None:
                continue
            if id(param) not in refs:
                names.append(prefix + attr)
                params.append(param)
                refs[id(param)] = []
            refs[id(param)].append(ParamRef(mod, attr))
        for cname, child in reversed(list(mod._modules.items())):
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
        hit = managed_tag(p)
        if hit is not None and hit.original:
            raise ShardingError(
                f"parameter {n!r} is shared with a module already sharded in another group (a {hit.owner}); one "
                "parameter can live in one group only. Fix: shard the modules that share it in one "
                "fully_shard call (e.g. leave tied embeddings and head to the root), or untie them"
            )
        if hit is not None:
            raise ShardingError(
                f"parameter {n!r} already belongs to a sharded group (of a {hit.owner}): fully_shard "
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


def _rules(semantics: object, params_by_name: Mapping[str, nn.Parameter]) -> object:
    """``semantics`` as fully_shard takes it; a plain callable gets ``(name, param)``."""
    if callable(semantics) and not isinstance(semantics, (BlockSemantics, SemanticsRules, type)):
        user: Callable = semantics

        def rule(name: str, _spec: TensorSpec) -> object:
            p = params_by_name[name]
            return call_user_semantics(user, (name, p), name, tuple(p.shape))

        return SemanticsRules.coerce(rule)
    return semantics


def _check_alignment(alignment_bytes: object) -> int:
    return check_alignment_bytes(alignment_bytes, error=ShardingError)


def fully_shard(
    module: nn.Module,
    *,
    mesh: object = None,
    reshard_after_forward: bool = True,
    mp_policy: Any = None,
    semantics: object = None,
    alignment_bytes: int = 16,
    policy: str = "whole",
) -> nn.Module:
    """Shard ``module``'s parameters (those not in an already sharded submodule) as one group.

    Apply bottom-up as with FSDP2: layers first, then the root. ``semantics`` gives each
    parameter its block semantics: a mapping ``glob -> semantics`` on parameter names relative to
    ``module``, a callable ``(name, param) -> semantics | None``, a semantics string or rules
    (default: ``elementwise``). ``alignment_bytes``: every bucket's per-rank segment is a
    multiple of it (16 suits vectorized kernels and NCCL). ``mp_policy`` is torch's
    ``MixedPrecisionPolicy`` (``param_dtype``, ``reduce_dtype``, ``output_dtype``,
    ``cast_forward_inputs``). ``policy`` places tensors whose compute units are coarser than their
    placement units (Muon matrices, experts; ``planner/_policy.py``): ``"whole"`` (each compute unit
    on one rank, the default), ``"owner"`` (storage cut at placement units; cut compute units get
    an owner rank, see :func:`blockshard.runtime.owner_plan`) or ``"auto"`` (per tensor, by a cost
    in bytes). Returns ``module``, whose class becomes a :class:`ShardedModule`
    (``unshard()``, ``reshard()``, ``set_requires_gradient_sync()``).
    """
    if not isinstance(module, nn.Module):
        raise ShardingError(f"module={module!r} must be a torch.nn.Module")
    if (done := state_of(module)) is not None:
        raise ShardingError(
            f"this {done.group.name} is already sharded: call fully_shard once per module "
            "(bottom-up: layers first, then the root)"
        )
    alignment_bytes = _check_alignment(alignment_bytes)
    policy = check_policy(policy)
    process_group = engine_group(_process_group(mesh))  # [Note: collective integrity], point 1
    install_optimizer_guard()  # an optimizer over replaced (pre-sharding) parameters raises at its first step
    install_torch_clip_route()  # torch.nn.utils.clip_grad_norm_ on local pieces: the global norm ([Note: clipping])
    names, params, refs = _collect(module)
    _check_params(names, params)
    name = type(module).__name__
    layout: GroupLayout | None = None
    items: list[PlanItem] = []
    owned: frozenset[str] = frozenset()
    if params:  # a root without parameters of its own still drives the hooks, as in FSDP2
        by_name = dict(zip(names, params, strict=True))
        specs = [
            TensorSpec(name=n, shape=tuple(p.shape), dtype=p.dtype, module_type=type(r[0].module).__name__)
            for n, p, r in zip(names, params, refs, strict=True)
        ]
        items = resolve_items(specs, _rules(semantics, by_name))
        layout, owned, _ = choose_layout(
            items, process_group.size(), policy, name=name, alignment_bytes=alignment_bytes, memo={}
        )
    check_same_layout(name, layout.layout_hash() if layout else "empty", process_group)
    index = {t.name: i for i, t in enumerate(layout.tensors)} if layout else {}
    sps = [
        ShardedParam(fqn=n, refs=r, shape=tuple(p.shape), requires_grad=p.requires_grad, index=index[n])
        for n, p, r in zip(names, params, refs, strict=True)
    ]
    group = ShardGroup(
        name,
        sps,
        params,
        layout,
        process_group,
        costs={it.name: it.cost for it in items},
        param_dtype=getattr(mp_policy, "param_dtype", None),
        reduce_dtype=getattr(mp_policy, "reduce_dtype", None),
    )
    state = ModuleState(
        module,
        group,
        reshard_after_forward=reshard_after_forward,
        param_dtype=getattr(mp_policy, "param_dtype", None),
        output_dtype=getattr(mp_policy, "output_dtype", None),
        cast_forward_inputs=getattr(mp_policy, "cast_forward_inputs", True),
    )
    state.order = next(_ORDER)  # see [Note: cost tally]
    record_compute(group, {it.name: it.grid for it in items if it.name in owned})
    for orig in params:
        tag_managed(orig, name, original=True)
    _tag_views(state)
    module.__dict__[STATE_ATTR] = state
    _swap_class(module)
    from blockshard.runtime._state_dict import install_state_dict_hooks  # imports this module

    install_state_dict_hooks(module)  # model.state_dict() speaks DCP ([Note: state dict entries])
    _balance_costs(module, state)
    return module


def _tag_views(state: ModuleState) -> None:
    for sp in state.group.params:
        tag_managed(
            sp.sharded, state.group.name, process_group=state.group.process_group, group=weakref.ref(state.group)
        )
        tag_managed(sp.unsharded, state.group.name)


# [Note: cost tally]
# Optimizer cost per rank (see [Note: rotation] in planner/_balance.py) is balanced over the groups
# of one model, in the order fully_shard made them (every rank makes the same calls in the same
# order). A call that shards a module with sharded submodules balances those not balanced yet
# (its subtree: the model, when it is the root) and then its own group, starting from the cost of
# the submodules balanced before; a group whose rotation changes moves its local buffer once, by
# whole segments across ranks, before any training. A leaf's group waits for an enclosing call.
# The tally thus belongs to the model's tree: two models built in one process never influence
# each other, whatever the order of their calls. ``_ORDER`` only numbers the calls.
_ORDER = itertools.count()


def _balance_costs(module: nn.Module, state: ModuleState) -> None:
    below = sorted(
        (st for m in module.modules() if m is not module and (st := state_of(m)) is not None),
        key=lambda st: st.order,
    )
    if not below:  # a leaf: balanced by the call that shards an enclosing module
        if compute_of(state.group):  # its own owners until then ([Note: engine owner plan])
            plan_owners(type(module).__name__, [("", state)], EngineOwnerBuilder(state.group.world_size, {}), None)
        return
    process_group = state.group.process_group
    W = process_group.size()
    prefixes = {id(m): f"{p}." if p else "" for p, m in module.named_modules()}
    named = [(prefixes[id(st.module)], st) for st in below]
    builder = EngineOwnerBuilder(W, {})
    running = np.zeros(W)
    for prefix, st in named:
        if st.balanced and st.group.layout is not None:  # balanced by an earlier call
            builder.add_fixed(*qualified_group(st, prefix), running)
    changed = False
    for prefix, st in [*((p, st) for p, st in named if not st.balanced), ("", state)]:
        st.balanced = True
        layout = st.group.layout
        if layout is None:
            continue
        q, kind, compute, costs = qualified_group(st, prefix)
        k = _rotation(q, builder.add_group(q, kind, compute, costs, running, 0.0, np.zeros(W)))
        if k:
            st.group.relayout(rotate(layout, k), k)
            _tag_views(st)
            changed = True
    if changed:
        hashes = ",".join(st.group.layout.layout_hash() for st in [*below, state] if st.group.layout is not None)
        check_same_layout(f"{type(module).__name__} (balanced)", hashes, process_group)
    plan_owners(type(module).__name__, [*named, ("", state)], builder, running)


def _rotation(old: GroupLayout, new: GroupLayout) -> int:
    """The ``k`` with ``new == rotate(old, k)`` (0 when nothing moved)."""
    if old is new:
        return 0
    W = old.world_size
    by_name = {t.name: t for t in new.tensors}
    for t in old.tensors:
        if t.numel:
            S = old.buckets[t.bucket]
            return ((by_name[t.name].offset - t.offset) // S) % W
    return 0


# -- inspection -------------------------------------------------------------------------------
def _states_under(model: nn.Module) -> list[tuple[str, ModuleState]]:
    return [(prefix, st) for prefix, m in model.named_modules() if (st := state_of(m)) is not None]


def group_layouts(model: nn.Module) -> dict[str, GroupLayout]:
    """The layout of every group under ``model``, by the sharded module's name."""
    return {prefix: st.group.layout for prefix, st in _states_under(model) if st.group.layout is not None}


def global_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every parameter's global shape by name (``model.named_parameters()`` names, tied names too).

    For a parameter the engine manages, the shape of the whole tensor, whatever piece (or empty
    ``(0,)`` piece) this rank holds; for any other parameter (not sharded, or an FSDP2 DTensor,
    whose ``shape`` is already global), its own shape. Names are stable across sharding.
    """
    managed = {
        id(p): sp.shape for _, st in _states_under(model) for sp in st.group.params for p in (sp.sharded, sp.unsharded)
    }
    return {n: managed.get(id(p), tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)}


def local_buffers(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """The buffers of every group, for memory checks: ``local`` (persistent) and ``grad`` while a
    sharded ``.grad`` views it (see [Note: buffers] in _group.py)."""
    out = {}
    for prefix, st in _states_under(model):
        if st.group.layout is not None:
            out[prefix] = {"local": st.group.local}
            if (grad := st.group.grad_buffer()) is not None:
                out[prefix]["grad"] = grad
    return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
