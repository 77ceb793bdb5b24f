"""``blockshard.fully_shard``: FSDP2's user surface on ragged, block-aligned layouts."""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np
import torch.distributed as dist
from torch import nn

from blockshard.planner import GroupLayout, PlanItem, resolve_items
from blockshard.planner._balance import rotate
from blockshard.planner._policy import check_policy, choose_layout
from blockshard.planner._tile_placement import packed_masters
from blockshard.planner._units import check_alignment_bytes
from blockshard.runtime._arguments import (
    check_fsdp_arguments,
    check_post_forward,
    check_quantized_below,
    check_same_settings,
    ignored_ids,
    process_group_of,
    replicate_group_of,
    reshard_after_forward_of,
)
from blockshard.runtime._placement import check_shard_placements
from blockshard.runtime.checkpoint._extra_dtypes import install_extra_state_dict_hooks
from blockshard.runtime.core._added import install_registration_count
from blockshard.runtime.core._buffer_set import BufferSet, GroupControls
from blockshard.runtime.core._buffers import ParamBuffers
from blockshard.runtime.core._collectives import check_same_layout, engine_group, uses_headers
from blockshard.runtime.core._dtypes import split_by_dtype
from blockshard.runtime.core._grad_sync import gradient_views_default
from blockshard.runtime.core._inspect import global_shape, global_shapes, group_layouts, local_buffers
from blockshard.runtime.core._list_groups import bind_below, collect_all, listed_modules
from blockshard.runtime.core._optim_checks import STRICT_ENV, strict
from blockshard.runtime.core._optim_guard import install_optimizer_guard
from blockshard.runtime.core._owners import (
    EngineOwnerPlanBuilder,
    build_owner_plan,
    compute_of,
    qualified_group,
    record_compute,
)
from blockshard.runtime.core._param import ParamRef, ShardedParam, check_plain, managed_tag, tag_managed
from blockshard.runtime.core._post_forward import post_forward_group
from blockshard.runtime.core._state import STATE_ATTR, ModuleState, state_of
from blockshard.runtime.core._tp import TPSpec, check_tp_units, tp_local, tp_spec_of
from blockshard.runtime.core._traffic import step_log_steps
from blockshard.runtime.quantized._frozen import FrozenQuantizedBuffers, collect_quantized, ignored_quantized
from blockshard.runtime.quantized._gather import QuantizedGatherBuffers, split_quantized_gather
from blockshard.runtime.quantized._tile_major import PackedTileOrder
from blockshard.semantics import BlockSemantics, SemanticsRules, TensorSpec
from blockshard.semantics._rule import call_user_semantics

__all__ = [
    "ShardedModule",
    "ShardingError",
    "UnshardHandle",
    "fully_shard",
    "global_shape",
    "global_shapes",
    "group_layouts",
    "is_sharded",
    "local_buffers",
]


from blockshard._errors import QuantizedWeightError, ShardingError
from blockshard.runtime.checkpoint._state_dict import install_state_dict_hooks
from blockshard.runtime.core._module import ShardedModule, UnshardHandle, mark_no_fsdp_state
from blockshard.runtime.routes import install_torch_routes

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
    mark_no_fsdp_state(module)  # an FSDPModule without FSDP2's state ([Note: an FSDPModule])


def is_sharded(module: nn.Module) -> bool:
    return state_of(module) is not None


def _state_of(module: nn.Module) -> ModuleState | None:
    return state_of(module)


def _warn_replicated_quantized(names: list[str]) -> None:
    """Quantized weights in ``ignored_params`` stay whole on every rank: said, never silent (a
    warning; an error under ``BLOCKSHARD_STRICT=1``)."""
    if not names:
        return
    text = (
        f"fully_shard(ignored_params=...): the quantized weight{'s' if len(names) > 1 else ''} "
        f"{', '.join(repr(n) for n in names[:3])}{' ...' if len(names) > 3 else ''} stay whole on every rank "
        "(replicated: no memory saved). Fix: leave them out of ignored_params (blockshard shards 4-bit, MX and "
        "FP8 weights in whole quantization groups: docs/quantized.md)"
    )
    if strict():
        raise QuantizedWeightError(text + f" ({STRICT_ENV}=1)")
    warnings.warn(text, stacklevel=3)


def _check_params(names: list[str], params: list[nn.Parameter], dp_group: dist.ProcessGroup) -> dict[str, TPSpec]:
    """Check the parameters a group takes; return the specs of its tensor-parallel DTensors
    ([Note: tensor-parallel parameters])."""
    specs: dict[str, TPSpec] = {}
    for n, p in zip(names, params, strict=True):
        hit = managed_tag(p)
        if hit is not None and hit.original:
            raise ShardingError(
                f"parameter {n!r} is shared with a module already sharded in another group (a {hit.group_name}); one "
                "parameter can live in one group only. Fix: shard the modules that share it in one "
                "fully_shard call (e.g. leave tied embeddings and head to the root), or untie them"
            )
        if hit is not None:
            raise ShardingError(
                f"parameter {n!r} already belongs to a sharded group (of a {hit.group_name}): fully_shard "
                "was applied top-down. Fix: apply it bottom-up — layers first, then the root"
            )
        spec = tp_spec_of(n, p, dp_group)
        if spec is not None:
            specs[n] = spec
            p = tp_local(p)  # what the group shards (checked as any parameter below)
        check_plain(n, p)  # a tensor subclass would lose what it holds besides its values
        if not p.is_contiguous():
            raise ShardingError(
                f"parameter {n!r} of shape {tuple(p.shape)} is not contiguous (strides {p.stride()}); the "
                "engine shards the row-major flattening. Fix: make it contiguous first, e.g. "
                "module.weight = nn.Parameter(module.weight.contiguous())"
            )
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ShardingError(
            f"the group's parameters are on several devices {sorted(map(str, devices))}; move the module to one device first"
        )
    return specs


def _rules(semantics: object, params_by_name: Mapping[str, nn.Parameter]) -> object:
    """``semantics`` as fully_shard takes it; a plain callable gets ``(name, param)``."""
    if callable(semantics) and not isinstance(semantics, (BlockSemantics, SemanticsRules, type)):
        user: Callable[..., object] = semantics

        def rule(name: str, _spec: TensorSpec) -> object:
            p = params_by_name[name]
            return call_user_semantics(user, (name, p), name, tuple(p.shape))

        return SemanticsRules.coerce(rule)
    return semantics


def _build_group(
    name: str,
    names: list[str],
    params: list[nn.Parameter],
    refs: list[list[ParamRef]],
    semantics: object,
    process_group: dist.ProcessGroup,
    policy: str,
    alignment_bytes: int,
    mp_policy: Any,
    replicate_group: dist.ProcessGroup | None,
    controls: GroupControls,
    trainable: bool,
    offload: bool = False,
    make: Callable[..., ParamBuffers] = ParamBuffers,
    packed: bool = False,
    tp: Mapping[str, TPSpec] | None = None,
) -> tuple[ParamBuffers, list[PlanItem], frozenset[str]]:
    """Plan ``params`` (one dtype) and make their group: its layout checked equal on every rank.
    ``packed``: the masters gathered quantized, their ``fp8_block`` weights in packed tile order
    (``tile_placement=True``; [Note: packed tile order in the engine] in quantized/_gather.py)."""
    layout: GroupLayout | None = None
    items: list[PlanItem] = []
    owned: frozenset[str] = frozenset()
    orders: dict[str, PackedTileOrder] = {}
    if params:  # a root without parameters of its own still drives the hooks, as in FSDP2
        by_name = dict(zip(names, params, strict=True))
        specs = [
            TensorSpec(name=n, shape=tuple(p.shape), dtype=p.dtype, module_type=type(r[0].module).__name__)
            for n, p, r in zip(names, params, refs, strict=True)
        ]
        rules = _rules(semantics, by_name)
        items = resolve_items(specs, rules)
        if packed:  # what plan_model(..., quantized_gather=True, tile_placement=True) lays out
            items, found = packed_masters(items, rules)
            orders = {n: PackedTileOrder(o.shape, o.tile, o.stacked) for n, o in found.items()}
        layout, owned, _ = choose_layout(
            items, process_group.size(), policy, name=name, alignment_bytes=alignment_bytes, memo={}
        )
    check_same_layout(name, layout.layout_hash() if layout else "empty", process_group)
    index = {t.name: i for i, t in enumerate(layout.tensors)} if layout else {}
    sps = [
        ShardedParam(
            fqn=n,
            refs=r,
            shape=tuple(p.shape),
            requires_grad=p.requires_grad,
            index=index[n],
            order=orders.get(n),
            tp=(tp or {}).get(n),
        )
        for n, p, r in zip(names, params, refs, strict=True)
    ]
    group = make(
        name,
        sps,
        params,
        layout,
        process_group,
        costs={it.name: it.cost for it in items},
        param_dtype=getattr(mp_policy, "param_dtype", None),
        reduce_dtype=getattr(mp_policy, "reduce_dtype", None),
        controls=controls,
        replicate_group=replicate_group,
        trainable=trainable,
        offload=offload,
    )
    return group, items, owned


def _check_tp(
    tp: Mapping[str, TPSpec],
    names: list[str],
    params: list[nn.Parameter],
    refs: list[list[ParamRef]],
    semantics: object,
    quantized_gather: bool,
) -> None:
    """What a group with tensor-parallel parameters does not support yet, refused by name; then no TP
    cut may split a unit of a parameter's semantics ([Note: tensor-parallel parameters])."""
    first = next(iter(tp))
    if quantized_gather:
        raise ShardingError(
            f"fully_shard(quantized_gather=True) with tensor-parallel parameters ({first!r} is a DTensor placed "
            f"{tp[first].label}) is not supported by blockshard's engine yet. Fix: drop quantized_gather"
        )
    by_name = dict(zip(names, params, strict=True))
    module_types = [type(r[0].module).__name__ for r in refs]
    check_tp_units(names, params, tp, _rules(semantics, by_name), module_types)


def _check_alignment(alignment_bytes: object) -> int:
    return check_alignment_bytes(alignment_bytes, error=ShardingError)


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: object = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: object = None,
    mp_policy: Any = None,
    offload_policy: object = None,
    ignored_params: object = None,
    semantics: object = None,
    alignment_bytes: int = 16,
    policy: str = "auto",
    quantized_gather: bool = False,
    tile_placement: bool | str = False,
) -> Any:
    """Shard ``module``'s parameters (those not in an already sharded submodule) as one group.

    Apply bottom-up as with FSDP2: layers first, then the root. ``semantics`` gives each
    parameter its block semantics: a mapping ``glob -> semantics`` on parameter names relative to
    ``module``, a callable ``(name, param) -> semantics | None``, a semantics string or rules
    (default: ``elementwise``). ``alignment_bytes``: every bucket's per-rank segment is a
    multiple of it (16 suits vectorized kernels and NCCL). ``mp_policy`` is torch's
    ``MixedPrecisionPolicy`` (``param_dtype``, ``reduce_dtype``, ``output_dtype``,
    ``cast_forward_inputs``). ``reshard_after_forward``: as FSDP2's (``None``: free the
    gathered parameters after forward, but the root's; an int ``k``, a factor of the shard group's
    size ``W``: ``1`` is False, ``W`` is True, and otherwise each rank keeps ``1/k`` of the
    parameters between forward and backward, whose all-gather then runs within ``k`` consecutive
    ranks; refused for groups with quantized weights: see [Note: reshard to a smaller world] in
    core/_post_forward.py). ``ignored_params``: parameters left as
    they are (not sharded, their gradients not reduced), as FSDP2's. ``offload_policy``: FSDP2's
    ``OffloadPolicy()`` (none) or ``CPUOffloadPolicy()``: local shards and gradients on the host,
    copied to the device to be gathered (parameters on the CPU or meta device only, so far).
    ``shard_placement_fn`` is FSDP2's per-parameter ``Shard(dim)`` choice: called and checked as
    FSDP2 does (a dim out of range raises), while the layout follows ``semantics`` (a storage cut
    changes no result; see [Note: shard placements] in _placement.py).
    ``policy`` places tensors whose compute units are coarser than their placement units (Muon
    matrices, experts; ``planner/_policy.py``): ``"whole"`` (each compute unit on one rank),
    ``"owner"`` (storage cut at placement units; cut compute units get an owner rank, see
    :func:`blockshard.runtime.owner_plan`) or ``"auto"`` (per tensor, by a cost in bytes; the default,
    as in ``plan_model`` and ``blockshard plan``: pair owner-computed matrices with
    ``blockshard.optim.OwnerComputeOptimizer`` or ``blockshard.optim.Muon``). Returns
    ``module``, whose class becomes a :class:`ShardedModule` (FSDP2's ``FSDPModule`` methods, see _module.py).
    A list ``[norm, head]`` makes one group over all their parameters, gathered before the first
    of them runs and resharded after the last (FSDP2's; see [Note: a list of modules] in
    _list_groups.py); the list is returned.
    ``quantized_gather=True``: floating-point parameters whose semantics is ``mx``, ``mx:4`` or
    ``fp8_block:B`` are all-gathered as their quantized tiles (payload and scales) and computed on
    dequantized (fake quantization; the master pieces train as floats). Call
    :func:`blockshard.precompute_quantized_gather` after ``optimizer.step()`` to quantize outside
    the hooks. See [Note: quantized gather] in _gather.py.
    ``tile_placement=True``: frozen blockwise-FP8 weights (``FP8Linear``-shaped modules) are placed
    by whole tiles in a tile-major order instead of by tile stripes, so a rank's piece may be any
    run of tiles (at most one tile of padding per rank where stripes pad up to one stripe: 50-82%
    at W >= 256 on 70B-class models). The gathered weight is the same row-major FP8 weight; its
    state-dict entries name their tiles as boxes, so DCP moves them between world sizes and
    placements. ``tile_placement="auto"``: per ``fully_shard`` call, tiles where they give a smaller
    segment than stripes (stripes on ties; they can pad less at small ``W``). See [Note: tile
    placement in the engine] in quantized/_frozen.py. With ``quantized_gather=True`` as well,
    ``tile_placement=True`` also places the trainable ``fp8_block:B`` masters by tiles, in padded
    tile order (every tile ``B x B``, edge tiles padded with zeros in the master only; [Note: padded
    tile order in the engine] in quantized/_gather.py): only element-wise optimizers (torch's SGD,
    Adam, AdamW, ...) may step them; under ``"auto"`` the masters keep their stripes.
    """
    arg = module
    modules = listed_modules(module) if isinstance(module, (list, tuple)) else (module,)
    if not isinstance(modules[0], nn.Module):
        raise ShardingError(f"module={module!r} must be a torch.nn.Module or a list of them")
    module = modules[0]
    check_fsdp_arguments(offload_policy)
    if not isinstance(quantized_gather, bool):
        raise ShardingError(
            f"quantized_gather={quantized_gather!r} must be True or False (True: gather the weights with 'mx', "
            "'mx:4' or 'fp8_block:B' semantics as their quantized tiles)"
        )
    if not (isinstance(tile_placement, bool) or tile_placement == "auto"):
        raise ShardingError(
            f"tile_placement={tile_placement!r} must be True, False or 'auto' (True: place frozen blockwise-FP8 "
            "weights by whole tiles rather than tile stripes; 'auto': per group, whichever pads less)"
        )
    for m in modules:
        if (done := state_of(m)) is not None:
            raise ShardingError(
                f"this {done.name} is already sharded: call fully_shard once per module "
                "(bottom-up: layers first, then the root)"
            )
    alignment_bytes = _check_alignment(alignment_bytes)
    policy = check_policy(policy)
    step_log_steps()  # a bad BLOCKSHARD_LOG / BLOCKSHARD_LOG_STEPS raises here, not at the first collective
    process_group = engine_group(process_group_of(mesh))  # [Note: collective integrity], point 1
    reshard_after_forward = reshard_after_forward_of(reshard_after_forward, process_group.size())
    replicate_group = replicate_group_of(mesh)
    check_same_settings(
        type(modules[0]).__name__,
        process_group,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
        offload_policy=type(offload_policy).__name__,
        quantized_gather=quantized_gather,
        tile_placement=tile_placement,
        policy=policy,
        alignment_bytes=alignment_bytes,
        collective_headers=uses_headers(process_group),  # BLOCKSHARD_COLLECTIVE_HEADERS ([Note: collective headers])
    )
    install_optimizer_guard()  # an optimizer over replaced (pre-sharding) parameters raises at its first step
    install_registration_count()  # [Note: parameters added after fully_shard]
    install_torch_routes()  # clip_grad_norm_, register_fsdp_forward_method, DCP's state-dict helpers ([Note: torch routes])
    ignored = ignored_ids(ignored_params)
    offload = type(offload_policy).__name__ == "CPUOffloadPolicy"  # [Note: CPU offload] in _buffers.py
    quantized = [
        f for m in modules for f in collect_quantized(m, ignored, is_sharded)
    ]  # [Note: frozen quantized buffers]
    _warn_replicated_quantized(ignored_quantized(modules, ignored))
    names, params, refs = collect_all(modules, ignored | {i for f in quantized for i in f.ids})
    tp = _check_params(names, params, process_group)
    originals = params
    if tp:  # [Note: tensor-parallel parameters]: the group shards the TP-local tensors
        _check_tp(tp, names, params, refs, semantics, quantized_gather)
        params = [tp_local(p) if n in tp else p for n, p in zip(names, params, strict=True)]
    if shard_placement_fn is not None:  # checked as FSDP2 does; the layout follows semantics ([Note: shard placements])
        check_shard_placements(cast(Callable[[nn.Parameter], object], shard_placement_fn), names, params)
    if offload and (dev := next((p.device for p in params if p.device.type not in ("cpu", "meta")), None)):
        raise ShardingError(
            f"offload_policy=CPUOffloadPolicy(): offloading parameters from {dev} to the CPU is not enabled in "
            "blockshard's engine yet: the training step's data flow is built (tested on the CPU), but the "
            "checkpoint, export and layout-shift collectives over the CPU shard are not staged through the "
            "device for NCCL, and no GPU run has checked it. Fix: drop offload_policy"
        )
    name = type(module).__name__ if len(modules) == 1 else f"[{', '.join(type(m).__name__ for m in modules)}]"
    # (name suffix, parameters, buffer set class, whether they may train) per buffer set
    parts: list[
        tuple[str | None, tuple[list[str], list[nn.Parameter], list[list[ParamRef]]], Callable[..., ParamBuffers], bool]
    ] = []
    if quantized_gather:  # [Note: quantized gather]: a buffer set of its own, after the dtypes' ones
        by_name = dict(zip(names, params, strict=True))
        q_part, (names, params, refs), quantizers = split_quantized_gather(
            names, params, refs, _rules(semantics, by_name)
        )
        if q_part[0]:
            qgather = functools.partial(QuantizedGatherBuffers, quantizers=quantizers)
            parts.append(("quantized gather", q_part, qgather, True))
        else:
            check_quantized_below(modules, semantics)
    dtypes = split_by_dtype(names, params, refs)  # [Note: mixed dtypes]: the primary first, the others frozen
    parts[:0] = [(None, part, ParamBuffers, k == 0) for k, part in enumerate(dtypes)]
    controls = GroupControls(
        gradient_views=gradient_views_default()
    )  # FSDP2's controls of this group, shared by its state and buffer sets
    groups: list[ParamBuffers] = []
    items, owned = [], frozenset[str]()
    for k, (label, (d_names, d_params, d_refs), make, trainable) in enumerate(parts):
        g_name = name if k == 0 else f"{name}[{label or str(d_params[0].dtype).removeprefix('torch.')}]"
        group, d_items, d_owned = _build_group(
            g_name, d_names, d_params, d_refs, semantics, process_group, policy, alignment_bytes,
            mp_policy if k == 0 or d_params[0].is_floating_point() else None, replicate_group, controls,
            trainable, offload, make, label == "quantized gather" and tile_placement is True, tp,
        )  # fmt: skip
        if d_owned and (len(modules) > 1 or k > 0):
            raise ShardingError(
                f"fully_shard of {name}: owner-computed tensors ({sorted(d_owned)[:3]}, policy={policy!r}) are "
                "not supported in a list's group or among a group's frozen parameters of another dtype yet. "
                "Fix: pass policy='whole', or shard the modules one by one"
            )
        groups.append(group)
        if k == 0:
            items, owned = d_items, d_owned
    group = groups[0]
    buffer_sets: list[BufferSet] = [*groups]  # [Note: buffer sets]: frozen quantized weights first
    if quantized:
        frozen = FrozenQuantizedBuffers(
            name, quantized, process_group, alignment_bytes=alignment_bytes, tile_placement=tile_placement
        )
        buffer_sets.insert(0, frozen)
    check_post_forward(name, reshard_after_forward, buffer_sets)
    if not isinstance(reshard_after_forward, bool) and isinstance(reshard_after_forward, int):
        smaller = post_forward_group(process_group, reshard_after_forward)  # [Note: reshard to a smaller world]
        for g in groups:
            g.post_forward = smaller
    state = ModuleState(
        module,
        group,
        reshard_after_forward=reshard_after_forward,
        param_dtype=getattr(mp_policy, "param_dtype", None),
        output_dtype=getattr(mp_policy, "output_dtype", None),
        cast_forward_inputs=getattr(mp_policy, "cast_forward_inputs", True),
        modules=modules,
        buffer_sets=buffer_sets,
    )
    state.order = next(_ORDER)  # see [Note: cost tally]
    state.ignored_ids = frozenset(ignored)  # left as they are: [Note: parameters added after fully_shard]
    record_compute(group, {it.name: it.grid for it in items if it.name in owned})
    for orig in originals:
        tag_managed(orig, name, original=True)
    for g in groups:
        g.tag_views()

    for m in modules:  # as FSDP2: each listed module gets the state and the class swap
        m.__dict__[STATE_ATTR] = state
        _swap_class(m)
        install_state_dict_hooks(m)  # model.state_dict() speaks DCP ([Note: state dict entries])
        install_extra_state_dict_hooks(m)
    if len(modules) == 1:
        bind_below(module)  # list groups under it get their names ([Note: a list of modules])
        _balance_costs(module, state)
    return arg


# [Note: cost tally]
# Optimizer cost per rank (see [Note: rotation] in planner/_balance.py) is balanced over the groups
# of one model, in the order fully_shard made them (every rank makes the same calls in the same
# order). A call that shards a module with sharded submodules balances those not balanced yet
# (its subtree: the model, when it is the root) and then its own group, starting from the cost of
# the submodules balanced before; a group whose rotation changes moves its local buffer once, by
# whole segments across ranks, and a group the owner builder re-bases at another tensor
# ([Note: shifts], ``apply_shifts`` in _owners.py) by one all_to_all_single, before any training. A leaf's group waits for an enclosing call.
# The tally thus belongs to the model's tree: two models built in one process never influence
# each other, whatever the order of their calls. ``_ORDER`` only numbers the calls.
_ORDER = itertools.count()


def _balance_costs(module: nn.Module, state: ModuleState) -> None:
    own = state_of(module)
    unique = {id(st): st for m in module.modules() if (st := state_of(m)) is not None and st is not own}
    below = sorted(unique.values(), key=lambda st: st.order)
    if not below:  # a leaf: balanced by the call that shards an enclosing module
        if compute_of(state.buffers):  # its own owners until then ([Note: engine owner plan])
            build_owner_plan(
                type(module).__name__, [("", state)], EngineOwnerPlanBuilder(state.buffers.world_size, {}), None
            )
        return
    process_group = state.buffers.process_group
    W = process_group.size()
    prefixes = {id(m): f"{p}." if p else "" for p, m in module.named_modules()}
    named = [(prefixes[id(st.module)], st) for st in below]
    builder = EngineOwnerPlanBuilder(W, {})
    running = np.zeros(W)
    for prefix, st in named:
        if st.balanced and st.buffers.layout is not None:  # balanced by an earlier call
            builder.add_fixed(*qualified_group(st, prefix), running)
    changed = False
    for prefix, st in [*((p, st) for p, st in named if not st.balanced), ("", state)]:
        st.balanced = True
        layout = st.buffers.layout
        if layout is None:
            continue
        q, kind, compute, costs = qualified_group(st, prefix)
        k = _rotation(q, builder.add_group(q, kind, compute, costs, running, 0.0, np.zeros(W)))
        if k:
            st.buffers.relayout(rotate(layout, k), k)
            st.buffers.tag_views()
            changed = True
    if changed:
        hashes = ",".join(st.buffers.layout.layout_hash() for st in [*below, state] if st.buffers.layout is not None)
        check_same_layout(f"{type(module).__name__} (balanced)", hashes, process_group)
    build_owner_plan(type(module).__name__, [*named, ("", state)], builder, running)


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
