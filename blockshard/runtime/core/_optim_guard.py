"""The optimizer guard: an optimizer over parameters that ``fully_shard`` replaced raises at its first step.

[Note: optimizer guard]
``fully_shard`` replaces every parameter of a group by a new ``nn.Parameter`` viewing the rank's
piece of the group's local buffer (see [Note: buffers] in _buffers.py). An optimizer built *before*
sharding (or over parameter lists taken before it) holds the replaced objects: they never get a
gradient again, so ``step()`` silently trains nothing. The replaced objects carry a
``ManagedTag(original=True)`` (_param.py), so one global optimizer step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``, registered once by the first
``fully_shard``) can tell: the first time an optimizer steps it looks at every parameter and raises
:class:`~blockshard.runtime.ShardingError` naming the first replaced one. Every rank builds its
optimizer the same way, so every rank raises.

Each message's fix is for what the user built: an ``OwnerComputeOptimizer`` or
``blockshard.optim.Muon`` notes its inner optimizer (:func:`note_inner`, a weak map that only
chooses message text), so a user of the wrapper is told what fixes it (build it after the last
``fully_shard`` / ``accelerator.prepare(model)``, over every rank's pieces), never to use it. A
whole-unit optimizer (torch's Muon, ``BlockedShampoo``) is refused only a piece that cuts one of its
compute units; a piece of whole units (Shampoo stripes, experts) of an owner-computed tensor is fine.

The same hook notes on each group's root context that an optimizer stepped its pieces
(``CollectiveTally.optimizer_stepped``): each end-of-step check counts the backwards after which
some optimizer had stepped the model, and compares the counts of the ranks that step at all, so an
``optimizer.step()`` that one rank skipped raises on every rank at the next backward
([Note: collective integrity] in _collectives.py). Calls are not counted: a rank may legitimately
run several optimizers, or none over a tensor it holds no element of (ranks that filter out
empty pieces build different optimizers), so one rank stepping twice is not caught.

The same hook runs the first-step optimizer checks (param_groups chosen by the pieces' shape, two
optimizers over one parameter, 8-bit state that would turn fp32: [Note: first-step optimizer
checks] in _optim_checks.py) once per optimizer, outside ``uncounted_steps`` and never for an inner
optimizer.

Cost: an optimizer is checked once per number of parameters it holds (``add_param_group`` makes
it check again); afterwards a step costs one weak-dictionary lookup and a sum over its
``param_groups``: measured 0.9 us (10 parameters) and 1.2 us (300) per step on this machine's CPU,
against 0.55 ms and 19 ms for the AdamW steps themselves (``timeit`` of ``_pre_step`` on a checked
``torch.optim.AdamW``, one thread); the first check of 300 parameters took 28 us. The cache is
keyed weakly by the optimizer, so it keeps nothing alive, and it never changes a result
(tests/runtime/test_fast_optim_selection.py checks that it checks once).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from blockshard._errors import ShardingError
from blockshard.runtime.core._common import ShardedState
from blockshard.runtime.core._optim_checks import check_first_step, check_still_one, checks_on
from blockshard.runtime.core._optim_facts import blockwise_semantics
from blockshard.runtime.core._owners import compute_of
from blockshard.runtime.core._param import managed_tag
from blockshard.semantics import fused_parts, straddled_boundary, tile_state_semantics

__all__ = ["check_optimizer", "install_optimizer_guard", "mark_stepped", "note_inner", "uncounted_steps"]

_handle: RemovableHandle | None = None  # the registered hook: installed once per process
# optimizer -> (the number of parameters it held when last checked, weak references to the groups
# of its sharded pieces): a cache, not state
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, tuple[Any, ...]]] = weakref.WeakKeyDictionary()


# optimizer -> the number of parameters it held at its first-step checks ([Note: first-step optimizer checks])
_first_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()

# inner optimizer -> the class name of the wrapper that made it: only for the messages, never a result
_inner_of: weakref.WeakKeyDictionary[torch.optim.Optimizer, str] = weakref.WeakKeyDictionary()


_INSTALL_LOCK = threading.Lock()


def install_optimizer_guard() -> None:
    """Register the global step pre-hook of [Note: optimizer guard] (idempotent)."""
    global _handle
    with _INSTALL_LOCK:  # ranks on threads may shard at once: one hook
        if _handle is None:
            _handle = register_optimizer_step_pre_hook(_pre_step)


class _Uncounted(threading.local):
    depth = 0  # > 0 inside uncounted_steps() on this thread


# Thread-local, not on a module or group: it marks a call in progress on the calling thread (the
# optimizer step inside ``uncounted_steps``), which no module or group describes; per thread, so
# one thread rank's uncounted step never hides another thread rank's training step.
_UNCOUNTED = _Uncounted()


@contextlib.contextmanager
def uncounted_steps() -> Iterator[None]:
    """Optimizer steps inside (on this thread) are not training steps (e.g. the learning-rate-0
    step that creates optimizer state before a checkpoint load): the end-of-step check does not
    count them."""
    _UNCOUNTED.depth += 1
    try:
        yield
    finally:
        _UNCOUNTED.depth -= 1


def mark_stepped(tensors: Any) -> None:
    """An optimizer that steps ``tensors`` (the model's pieces) through tensors of its own (owner
    compute: whole units on their owners) stepped them: their groups' end-of-step checks count it,
    as the step pre-hook counts an optimizer that holds the pieces ([Note: optimizer guard])."""
    if _UNCOUNTED.depth:
        return
    for p in tensors:
        tag = managed_tag(p)
        group = None if tag is None or tag.group is None else cast(Callable[[], Any], tag.group)()  # a weakref.ref
        if group is not None and group.tally is not None:
            group.tally.optimizer_stepped = True


def _pre_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    seen = _checked.get(optimizer)
    if seen is None or seen[0] != count:
        seen = (count, check_optimizer(optimizer))
        _checked[optimizer] = seen
    # [Note: first-step optimizer checks]: at the first training step (an uncounted step, e.g. the
    # state-creating one of a checkpoint load, runs on the ranks that need it only), never for an
    # inner optimizer (it holds the pieces whole on their owners: ranks hold other pieces)
    if not _UNCOUNTED.depth and _first_checked.get(optimizer) != count and optimizer not in _inner_of:
        check_first_step(optimizer)
        _first_checked[optimizer] = count
    check_still_one(optimizer)
    for ref in seen[1]:
        group = ref()
        if group is None:
            continue
        if group.sharded_state is not ShardedState.SHARDED:
            group.reshard()  # kept gathered (set_reshard_after_backward(False)): the next forward gathers the new values
        if group.tally is not None and not _UNCOUNTED.depth:
            group.tally.optimizer_stepped = True


def note_inner(inner: torch.optim.Optimizer, outer: str) -> None:
    """``inner`` is the inner optimizer of an ``outer`` (``OwnerComputeOptimizer``, ``Muon``): the
    guard's messages then name what fixes the wrapper, not the wrapper itself."""
    if isinstance(inner, torch.optim.Optimizer):  # the guard sees only optimizers
        _inner_of[inner] = outer


def _whole_unit_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """torch's Muon or blockshard's BlockedShampoo: they compute on whole matrices / tiles."""
    return _is_torch_muon(optimizer) or type(optimizer).__name__ == "BlockedShampoo"


def _is_torch_muon(optimizer: torch.optim.Optimizer) -> bool:
    cls = type(optimizer)
    return cls.__name__ == "Muon" and cls.__module__.startswith("torch.optim")


def _wrapped_fix(optimizer: torch.optim.Optimizer) -> str:
    """The fix for a whole-unit optimizer that holds a cut piece, for what the user built."""
    outer = _inner_of.get(optimizer)
    if outer is not None:  # the user already wraps it: what fixes the wrapper
        return (
            f"build the {outer} after the last fully_shard (with Accelerate: after accelerator.prepare(model)), "
            "on every rank, over every rank's pieces (model.named_parameters() or muon_param_groups(model), "
            "unfiltered: it keeps the empty pieces of owner-computed tensors), or shard with policy='whole'"
        )
    name = type(optimizer).__name__
    if name == "BlockedShampoo":
        wrap = "blockshard.optim.OwnerComputeOptimizer(lambda groups: BlockedShampoo(groups, ...), model.named_parameters())"
    else:
        wrap = (
            "blockshard.optim.Muon([muon_group], ...) or blockshard.optim.OwnerComputeOptimizer(lambda groups: "
            "torch.optim.Muon(groups, ...), [muon_group]), muon_group = muon_param_groups(model)[0]"
        )
    return f"step it with {wrap}, built after the last fully_shard, or shard with policy='whole'"


_ELEMENT_WISE = frozenset(
    {"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta", "ASGD"}
)


def _element_wise(optimizer: torch.optim.Optimizer) -> bool:
    """torch's own optimizers whose step and state are element by element (a piece in any order
    steps as the whole tensor does): the ones a packed tile order's pieces may reach."""
    cls = type(optimizer)
    return cls.__module__.startswith("torch.optim") and cls.__name__ in _ELEMENT_WISE


def _cuts_a_unit(sp: Any, grid: Any) -> bool:
    """Whether this rank's piece ``[local_start, local_start + local_numel)`` cuts a compute unit."""
    if sp.local_numel in (0, sp.numel):
        return False
    return not (grid.allows_cut(sp.local_start) and grid.allows_cut(sp.local_start + sp.local_numel))


def _pieces_of(group: Any) -> dict[int, Any]:
    """A group's ShardedParams by their piece: ``id(sp.sharded) -> sp`` (the first, as a scan of
    ``group.params`` finds it), built once per group so the checks below look a piece up in O(1)."""
    return {id(sp.sharded): sp for sp in reversed(group.params)}


def _check_stored_order(optimizer: torch.optim.Optimizer, p: torch.Tensor, sp: Any, name: str | None) -> None:
    """A piece stored in another order than row-major (a master in packed tile order) reaches only
    element-wise optimizers: any other would compute on (or keep blockwise state of) values that
    are neighbours in that order, not in the weight. ``sp``: the piece's ShardedParam (None: none)."""
    if sp is None or _element_wise(optimizer):
        return
    if sp.order is not None:
        raise ShardingError(
            f"{type(optimizer).__name__} holds this rank's piece {tuple(p.shape)} of {name or sp.fqn!r} (global "
            f"shape {sp.shape}), stored in {sp.order.name} order (fully_shard(..., quantized_gather=True, "
            "tile_placement=True)): only element-wise optimizers (torch's SGD, Adam, AdamW, ...) step such a piece "
            "as one process steps the weight; this one computes on blocks or keeps blockwise state. Fix: shard "
            "with tile_placement=False or 'auto' (the masters keep row-major stripes), or step these weights with "
            "an element-wise optimizer"
        )


def _tile_semantics(optimizer: torch.optim.Optimizer, options: dict[str, Any]) -> str | None:
    """``"shampoo:D"`` for blockshard's BlockedShampoo, ``D`` the param_group's max_preconditioner_dim."""
    name = type(optimizer).__name__
    return tile_state_semantics(
        name, options.get("max_preconditioner_dim", optimizer.defaults.get("max_preconditioner_dim"))
    )


def _check_tp_cut(
    optimizer: torch.optim.Optimizer, p: torch.Tensor, sp: Any, name: str | None, options: dict[str, Any]
) -> None:
    """A piece of a tensor-parallel parameter whose tp placement cuts it ([Note: tensor-parallel
    parameters]) reaches only element-wise optimizers (torch's SGD, Adam, AdamW, ...) and
    ``blockshard.optim.Muon`` (Newton-Schulz on the matrix gathered across tp), and blockwise 8-bit
    optimizers and BlockedShampoo whose blocks (``D x D`` tiles) the tp cut keeps whole (the same blocks
    as one process's, the same 8-bit / fp32 choice): any other computes on (or keeps blockwise state
    of) the TP-local tensor alone, where one process computes on the whole. ``sp``: the piece's
    ShardedParam (None: none); ``options``: the param_group holding ``p``.

    [Note: tiles across tp]
    BlockedShampoo tiles a matrix into ``D x D`` blocks from ``(0, 0)`` and nothing in its step looks
    at more than one block (optim/_shampoo.py). A tp cut at a multiple of ``D`` rows (``Shard(0)``) or
    columns (``Shard(1)``) leaves each tp rank whole tiles, starting at a tile corner: Shampoo on the
    TP-local matrix (dp-sharded in ``D``-row stripes as without TP) is Shampoo on the global one,
    tile by tile. Any other cut splits tiles, and is refused (at ``fully_shard`` when the semantics
    say ``shampoo:D``, here when the optimizer's ``D`` differs from them)."""
    across = getattr(optimizer, "computes_across_tp", False)  # blockshard.optim.Muon's inner optimizer
    if sp is None or _element_wise(optimizer) or across or not checks_on():
        return
    tp = sp.tp
    if tp is None or not tp.cut:
        return
    # 8-bit blocks or Shampoo tiles the tp cut keeps whole: stepped as one process steps them (every
    # block's state and math are its own, [Note: tiles across tp])
    tiles = _tile_semantics(optimizer, options)
    blocks = blockwise_semantics(optimizer) or tiles
    if blocks is not None and not tp.splits_units(sp.fqn, p.dtype, blocks):
        return
    if tiles is not None:
        dim = int(tiles.split(":")[1])
        raise ShardingError(
            f"{type(optimizer).__name__} holds this rank's piece {tuple(p.shape)} of {name or sp.fqn!r}, a "
            f"tensor-parallel parameter placed {tp.label} (global shape {tp.shape}, {sp.shape} on this tp rank): "
            f"the tp cut splits its {dim} x {dim} preconditioner tiles, so it would precondition parts of tiles "
            "where one process preconditions whole ones. Fix: a max_preconditioner_dim that divides the tp cut "
            f"(this tp rank's {sp.shape[tp.shard_dim]} along dim {tp.shard_dim}), or leave it out of the TP plan "
            "(replicated over tp)"
        )
    raise ShardingError(
        f"{type(optimizer).__name__} holds this rank's piece {tuple(p.shape)} of {name or sp.fqn!r}, a "
        f"tensor-parallel parameter placed {tp.label} (global shape {tp.shape}, {sp.shape} on this tp rank): "
        "it would compute on this tp rank's part alone, where one process computes on the whole tensor "
        "(Newton-Schulz on a part of the matrix, 8-bit blocks or tiles across the cut). Fix: step it with "
        "blockshard.optim.Muon (Muon on the matrix gathered across tp) or an element-wise optimizer (torch's "
        "AdamW, ...), or leave it out of the TP plan (replicated over tp)"
    )


def _check_not_cut(optimizer: torch.optim.Optimizer, p: torch.Tensor, group: Any, sp: Any, name: str | None) -> None:
    """A piece of an owner-computed tensor (``fully_shard(..., policy="owner" | "auto")``) that
    cuts one of its compute units must not reach an optimizer that computes on whole units: it would
    orthogonalize (precondition) this rank's part of the unit alone, silently. A piece made of whole
    units (whole Shampoo stripes, whole experts) is fine. ``sp``: the piece's ShardedParam in
    ``group`` (None: none)."""

    if group is None or sp is None:
        return
    compute = compute_of(group)
    if (
        sp.fqn not in compute
        and 0 < sp.local_numel < sp.numel
        and _is_torch_muon(optimizer)
        and checks_on()  # BLOCKSHARD_OPTIMIZER_CHECKS=0 (a control that shows what Muon on stripes computes)
    ):
        raise ShardingError(
            f"{type(optimizer).__name__} holds this rank's piece {tuple(p.shape)} of {name or sp.fqn!r} (global "
            f"shape {sp.shape}), a part of the matrix (its semantics cut it): Newton-Schulz on a part is not "
            f"Muon of the matrix, as one process computes it. Fix: shard the matrices Muon steps with Muon's "
            f"semantics (fully_shard(..., semantics=blockshard.optim.optimizer_semantics("
            f"muon_param_groups(model)))), or {_wrapped_fix(optimizer)}"
        )
    if sp.fqn in compute and _cuts_a_unit(sp, compute[sp.fqn]):
        raise ShardingError(
            f"{type(optimizer).__name__} holds this rank's piece {tuple(p.shape)} of "
            f"{name or sp.fqn!r} (global shape {sp.shape}), which fully_shard(policy='owner'/'auto') "
            f"cut inside a compute unit and gave an owner rank: it would compute on the piece alone. Fix: "
            f"{_wrapped_fix(optimizer)}"
        )


def _check_fused(
    optimizer: torch.optim.Optimizer, p: torch.Tensor, group: Any, sp: Any, name: str | None, options: dict[str, Any]
) -> None:
    """A piece of a fused weight (``parts`` semantics, [Note: fused parts] in semantics/_builtins.py)
    must not reach an optimizer that would compute across its parts: torch's Muon (the fused matrix
    orthogonalized as one), BlockedShampoo whose ``D``-row tiles straddle a part boundary. ``sp``: the
    piece's ShardedParam in ``group`` (None: none); ``options``: the param_group holding ``p``."""
    layout = getattr(group, "layout", None)
    if layout is None or sp is None or not checks_on():
        return
    parts = fused_parts(layout.tensors[sp.index].semantics)
    if not parts:
        return
    what = (
        f"this rank's piece {tuple(p.shape)} of {name or sp.fqn!r} (global shape {sp.shape}), a fused weight of parts"
    )
    if _is_torch_muon(optimizer):
        raise ShardingError(
            f"{type(optimizer).__name__} holds {what} {':'.join(map(str, parts))} rows: torch's Muon would "
            "orthogonalize the fused matrix as one, where the parts are separate matrices. Fix: step it with "
            "blockshard.optim.Muon (Muon per part), or drop its 'parts' semantics if one matrix is meant"
        )
    tiles = _tile_semantics(optimizer, options)
    dim = int(tiles.split(":")[1]) if tiles is not None else 0
    off = straddled_boundary(parts, dim) if dim else None
    if off is not None:
        raise ShardingError(
            f"{type(optimizer).__name__} holds {what} {':'.join(map(str, parts))} rows: its {dim} x {dim} tiles "
            f"would hold rows of two parts (a part boundary at row {off}). Fix: a max_preconditioner_dim that "
            "divides every part's rows, or drop the 'parts' semantics"
        )


def _stale_fix(optimizer: torch.optim.Optimizer) -> str:
    """The fix for an optimizer over parameters that fully_shard replaced, for what the user built."""
    outer = _inner_of.get(optimizer)
    what = f"the {outer}" if outer is not None else "the optimizer"
    over = (
        "muon_param_groups(model) called after sharding"
        if outer is not None or _whole_unit_optimizer(optimizer)
        else "model.parameters() (or blockshard.optim.muon_param_groups(model) called after sharding)"
    )
    return (
        f"build {what} after fully_shard, over {over}; after the last fully_shard if you shard bottom-up "
        "(with Accelerate: after accelerator.prepare(model))"
    )


def check_optimizer(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """Raise ``ShardingError`` if ``optimizer`` holds a parameter that ``fully_shard`` replaced;
    else return weak references to the groups of its sharded pieces."""
    groups: dict[int, Any] = {}
    pieces: dict[int, tuple[Any, dict[int, Any]]] = {}  # id(group) -> (the group, kept alive; _pieces_of(it))
    for i, group in enumerate(optimizer.param_groups):
        names = group.get("param_names")
        names = list(names) if isinstance(names, (list, tuple)) and len(names) == len(group["params"]) else None
        for j, p in enumerate(group["params"]):
            tag = managed_tag(p)
            if tag is not None and tag.original:
                what = f"parameter {names[j]!r}" if names is not None else "a parameter"
                if tag.replaced_by is not None:  # a conversion after fully_shard ([Note: converting a sharded model])
                    replaced, fix = tag.replaced_by, "build the optimizer after converting the model, as with FSDP2"
                else:
                    replaced, fix = "fully_shard replaced by its local piece", _stale_fix(optimizer)
                raise ShardingError(
                    f"{type(optimizer).__name__} holds {what} of shape {tuple(p.shape)} "
                    f"(param_groups[{i}]['params'][{j}]) that {replaced} "
                    f"(in the group of a {tag.group_name}): stepping it would train nothing. Fix: {fix}"
                )
            if tag is not None and tag.group is not None:
                groups.setdefault(id(tag.group), tag.group)
                ref = cast(Callable[[], Any], tag.group)  # a weakref.ref to the ParamBuffers
                group_of_p = ref()
                sp = None
                if group_of_p is not None:
                    if id(group_of_p) not in pieces:  # the group's pieces, indexed once (not a scan per piece)
                        pieces[id(group_of_p)] = (group_of_p, _pieces_of(group_of_p))
                    sp = pieces[id(group_of_p)][1].get(id(p))
                name = names[j] if names is not None else None
                _check_stored_order(optimizer, p, sp, name)
                _check_tp_cut(optimizer, p, sp, name, group)
                if _whole_unit_optimizer(optimizer):
                    _check_not_cut(optimizer, p, group_of_p, sp, name)
                    _check_fused(optimizer, p, group_of_p, sp, name, group)
    return tuple(groups.values())
