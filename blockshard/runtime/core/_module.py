"""``ShardedModule``: what ``fully_shard`` makes of a module, with FSDP2's ``FSDPModule`` controls.

[Note: an FSDPModule]
``ShardedModule`` subclasses torch's ``FSDPModule``, so ``isinstance(m, FSDPModule)`` holds for a
module ``blockshard.fully_shard`` sharded and the code that dispatches on it (Accelerate's FSDP2
preparation, the HF Trainer, torchtitan, torch's pipelining schedules) takes the FSDP2 branch.
Every method of ``FSDPModule`` is overridden here (the public ones, ``_apply``,
``_set_unshard_async_op``, ``__new__``), so torch's code never runs on a blockshard module;
what reads FSDP2's internal state instead (``FSDPModule._get_fsdp_state``,
``fully_shard.state(module)``) gets a :class:`ShardingError` naming blockshard's way, but for the
two entry points torch's pipelining drives ([Note: pipelining's gradient reduction]). Each place
in torch, Accelerate and transformers that checks the class is listed, with what it does then, in
docs/engine.md ("isinstance(m, FSDPModule)") and tested in tests/runtime/test_fast_fsdp_module.py.

[Note: converting a sharded model]
``model.to(torch.float64)``, ``.half()``, ``.double()``, ``.bfloat16()`` after ``fully_shard`` do
what they do under FSDP2 (whose ``_apply`` converts the sharded parameters and makes new DTensors
over them): each group's local buffer is converted by torch's own function (element-wise, so the
pieces hold what converting the whole parameters would), the gathered buffer, the send buffer and
the gradients are made in the new dtype, and the module gets new parameter objects over them
(``ParamBuffers.convert``). ``mp_policy`` keeps meaning what it said: a ``param_dtype`` or
``reduce_dtype`` it set stays; one it left unset follows the new dtype. Buffers and parameters
the engine does not hold are converted by torch, as always. As under FSDP2, an optimizer is built
after: the old pieces are tagged replaced, so an optimizer built before raises at its first step
([Note: optimizer guard] in _optim_guard.py), naming the conversion. Refused, each by a
``ShardingError`` naming the group and the fix: a conversion while gradients are held (they would
keep the old dtype), of weights all-gathered quantized (their quantizer is planned for the
master's dtype), and moving to another device (the engine's collectives are bound to its device;
``model.to_empty(device=...)`` of a model sharded on the meta device is the supported move).

Every control keeps FSDP2's name, arguments and meaning (torch 2.13,
``torch/distributed/fsdp/_fully_shard/_fully_shard.py``); where blockshard's engine has nothing
to control (its reduce-scatter completes inside backward, its collectives run on the current
stream) the control validates its argument and says so in its
docstring, so FSDP2 code runs unchanged and never silently means something else.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import UnshardHandle as FSDPUnshardHandle

from blockshard._errors import ShardingError
from blockshard.runtime.core._module_comms import CommControls
from blockshard.runtime.core._state import ModuleState, state_of

__all__ = [
    "ShardedModule",
    "ShardingError",
    "UnshardHandle",
    "mark_no_fsdp_state",
    "not_fsdp_state",
    "register_forward_method",
    "unswapped_class",
]


class UnshardHandle(FSDPUnshardHandle):
    """What ``module.unshard(async_op=True)`` returns: ``wait()`` finishes the all-gathers (an
    FSDP2 ``UnshardHandle``, as code that keeps them expects)."""

    def __init__(self, state: ModuleState) -> None:
        self._state = state

    def wait(self) -> None:
        self._state.wait_unshard()


class ShardedModule(CommControls, FSDPModule, nn.Module):
    """What ``fully_shard`` makes of a module (as FSDP2's ``FSDPModule``, which it subclasses:
    [Note: an FSDPModule]).

    ``fully_shard(m)`` swaps ``m``'s class for ``BlockShard<Class>``, a subclass of both this class
    and ``m``'s own, so ``isinstance(m, ShardedModule)`` and ``isinstance(m, FSDPModule)`` hold and
    the methods below exist; the engine's state lives on the module (``m._blockshard_state``),
    nowhere else.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """As FSDP2's: constructing a swapped class (``type(m)(...)``: a ``ModuleList`` or
        ``Sequential`` sliced) constructs the model's own class, not sharded."""
        own = unswapped_class(cls)
        module = own.__new__(own, *args, **kwargs)
        module.__init__(*args, **kwargs)
        return module

    def _get_fsdp_state(self) -> NoReturn:
        """torch code that reaches into FSDP2's internal state (not its public methods) cannot
        drive a blockshard module: it raises, naming blockshard's way ([Note: an FSDPModule])."""
        raise ShardingError(not_fsdp_state(self))

    def _bs_state(self) -> ModuleState:
        state = state_of(self)
        if state is None:
            raise ShardingError(f"this {type(self).__name__} has no blockshard state; shard it with fully_shard")
        return state

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (``async_op=True``: return a handle to ``wait()``)."""
        state = self._bs_state()
        state.unshard(async_op=async_op)
        return UnshardHandle(state) if async_op else None

    def reshard(self) -> None:
        """Free the gathered parameters; the module holds its local pieces again."""
        self._bs_state().reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Off: backward accumulates unsharded gradients without a reduce-scatter (micro-batches)."""
        if not isinstance(requires_gradient_sync, bool):
            raise ShardingError(f"requires_gradient_sync={requires_gradient_sync!r} must be True or False")
        for st in self._states(recurse):
            st.controls.requires_gradient_sync = requires_gradient_sync  # every buffer set's ([Note: buffer sets])

    # -- FSDP2's controls -------------------------------------------------------------------------
    def _states(self, recurse: bool) -> list[ModuleState]:
        mods = self.modules() if recurse else [self]
        return list({id(st): st for m in mods if (st := state_of(m)) is not None}.values())  # a list's group once

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether to free the gathered parameters after forward (re-gathered in backward); this
        also sets the root's, which ``reshard_after_forward=None`` leaves gathered."""
        _check_bool("reshard_after_forward", reshard_after_forward)
        for st in self._states(recurse):
            st.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Off: keep the parameters gathered after backward (micro-batches without an optimizer
        step between them skip the next forward's all-gather). ``optimizer.step()`` over the
        group's parameters reshards it first, so the next forward gathers the new values."""
        _check_bool("reshard_after_backward", reshard_after_backward)
        for st in self._states(recurse):
            st.controls.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters (asynchronously) right after this module's, in
        forward, instead of the next module of the recorded order."""
        self._bs_state().forward_prefetch = _prefetch_states("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters (asynchronously) when this module's backward
        starts, instead of the previous module of the recorded order."""
        self._bs_state().backward_prefetch = _prefetch_states("set_modules_to_backward_prefetch", modules)

    def set_gradient_views(self, gradient_views: bool | None, *, recurse: bool = True) -> None:
        """On: autograd accumulates the unsharded gradients straight into the reduce-scatter input
        (no copy into it); off: into tensors of their own, copied in when the group's backward is
        over; ``None`` (the default): on where the backend reduce-scatters in place (NCCL), off
        where it clones its input anyway (gloo on the CPU), where the views would only take the
        input's memory earlier ([Note: gradient views] in _grad_sync.py)."""
        if gradient_views is not None and not isinstance(gradient_views, bool):
            raise ShardingError(
                f"set_gradient_views(gradient_views={gradient_views!r}): pass True, False or None (the default: "
                "on where the backend reduce-scatters in place)"
            )
        for st in self._states(recurse):
            st.controls.gradient_views = gradient_views

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2 waits for pending reduce-scatters on the last backward only; blockshard waits for
        them at the end of every backward ([Note: async reduce-scatter] in _grad_sync.py), so
        every backward is already "last": accepted, nothing to change."""
        _check_bool("is_last_backward", is_last_backward)
        self._bs_state().is_last_backward = is_last_backward

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP (a 2-D mesh): off, backward reduce-scatters but does not all-reduce across the
        replicate axis; the segments are kept and added into the next all-reduce ([Note: HSDP]
        in _grad_sync.py). Without a replicate axis there is nothing to skip."""
        _check_bool("requires_all_reduce", requires_all_reduce)
        for st in self._states(recurse):
            st.controls.requires_all_reduce = requires_all_reduce

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of averaging over the ranks (this
        module's group only, as FSDP2)."""
        if (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not (math.isfinite(factor) and factor > 0)
        ):
            raise ShardingError(
                f"set_gradient_divide_factor(factor={factor!r}): factor must be a finite number > 0 (the gradients "
                "are summed over the ranks, then divided by it; the default divides by the world size)"
            )
        self._bs_state().controls.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Off: backward does not all-gather this module's group (nor prefetches it), for groups
        whose parameters backward does not read (an embedding's); gradients are reduced as
        usual. This module's group only, as FSDP2."""
        _check_bool("unshard_in_backward", unshard_in_backward)
        self._bs_state().unshard_in_backward = unshard_in_backward

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """FSDP2 issues the hooks' all-gathers with ``async_op`` on the default stream; blockshard's
        hooks issue every buffer set's all-gather asynchronously and wait before the module runs
        anyway ([Note: streams] in _common.py): accepted, nothing to change."""
        _check_bool("async_op", async_op)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """FSDP2 makes the next all-gathers wait for ``event`` on their own stream; the engine's
        all-gather stream waits for the current stream, where the optimizer stepped, anyway
        ([Note: streams] in _common.py): accepted."""
        if not hasattr(event, "wait") or not hasattr(event, "record"):
            raise ShardingError(
                f"set_post_optim_event(event={event!r}): pass a torch.Event (or torch.cuda.Event) recorded "
                "after optimizer.step()"
            )

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: reshard every group, drop the
        partial gradients and reset the per-step state, so the next step runs normally. Call it
        on the root (the module whose forward runs first)."""
        state = self._bs_state()
        if state.ctx is not None and not state.is_root:
            raise ShardingError(
                f"reset_iter_state() on {state.name!r}, which is not the root: call it on the module "
                "fully_shard was applied to last (the one whose forward runs first)"
            )
        if state.ctx is not None:
            state.ctx.reset_step()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ShardedModule:
        """``.to(dtype)``, ``.double()``, ``.half()``...: the engine's buffers converted, as FSDP2
        converts its sharded parameters ([Note: converting a sharded model]); moves to another device
        are refused (but for ``model.to_empty(device=...)`` of a model sharded on the meta device,
        [Note: meta init])."""
        if self._bs_state().applying:  # an enclosing sharded module's _apply has handled this one's groups
            applied: ShardedModule = super(FSDPModule, self)._apply(fn, recurse)  # type: ignore[no-untyped-call]  # the model's own, past FSDP2's
            return applied
        states = self._states(True)
        groups = [(st, g) for st in states for g in st.param_buffers if g.layout is not None]
        # a list's group ([Note: a list of modules]) is checked and materialized with its first
        # module's subtree (its parameters are hidden from torch in every listed module's)
        inside = {id(m) for m in self.modules()}
        mine = [(st, g) for st, g in groups if id(st.modules[0]) in inside]
        converting = []
        for st, g in mine:  # every group checked before any changes
            probe = g.local[:1]
            out = fn(probe)
            if g.device.type == "meta" and out.device.type != "meta" and out.dtype == probe.dtype:
                continue  # materialized below
            if out is probe:
                continue
            if out.device != probe.device:
                raise ShardingError(
                    f"moving a sharded module to another device (model.to(device), .cuda(), .cpu()) would move the "
                    f"parameters of group {g.name!r} from {g.device} to {out.device}, away from the engine's "
                    "buffers and collectives (not supported after fully_shard). Fix: move the model before "
                    "fully_shard, or shard it on the meta device and materialize it with model.to_empty(device=...)"
                )
            g.check_convertible(out.dtype)
            converting.append((st, g))
        for _, g in mine:
            if g.device.type == "meta" and fn(g.local[:1]).device.type != "meta":
                g.materialize(fn(g.local[:1]).device)
        for st, _ in converting:
            st.reshard()  # as FSDP2's _apply: the sharded parameters are the ones converted
        for _, g in converting:
            g.convert(fn)
        # the rest (buffers, unsharded parameters) as torch does; the engine's own parameters are
        # hidden meanwhile, so torch does not replace their data
        hidden = [(ref, ref.module._parameters[ref.attr]) for _, g in groups for sp in g.params for ref in sp.refs]
        for ref, _ in hidden:
            ref.module._parameters[ref.attr] = None
        for st in states:  # torch's _apply recurses into them next: their groups are handled here
            st.applying = True
        try:
            applied = super(FSDPModule, self)._apply(fn, recurse)  # type: ignore[no-untyped-call]  # the model's own, past FSDP2's
            return applied
        finally:
            for st in states:
                st.applying = False
            for ref, p in hidden:
                ref.module._parameters[ref.attr] = p

    def __deepcopy__(self, memo: dict[int, object]) -> NoReturn:
        raise ShardingError(
            f"copy.deepcopy of a sharded {self._bs_state().name} is not supported: the copy would share "
            "the original's buffers and collectives (its unshard() would unshard the original). Fix: "
            "deepcopy the model before fully_shard and shard the copy, or build a second model"
        )


def unswapped_class(cls: type) -> type:
    """The model's own class for a class ``fully_shard`` swapped in (``BlockShard<Class>``); any
    other class itself."""
    if not issubclass(cls, ShardedModule):
        return cls
    return next(b for b in cls.__mro__[1:] if not issubclass(b, (ShardedModule, CommControls, FSDPModule)))


def not_fsdp_state(module: nn.Module) -> str:
    """What a torch function that reads FSDP2's internal state of a blockshard module is told."""
    return (
        f"this {type(module).__name__} was sharded by blockshard.fully_shard: it is an FSDPModule (every public "
        "FSDPModule method works on it), but it has no FSDP2 internal state (FSDPModule._get_fsdp_state, "
        "fully_shard.state) for torch code to drive. That code (torch's share_comm_ctx, FSDPMemTracker, "
        "or register_fsdp_forward_method with "
        "BLOCKSHARD_TORCH_ROUTES off) is not supported on blockshard modules. Fix: use the public methods, "
        "blockshard.register_forward_method for a forward method, or shard this module with "
        "torch.distributed.fsdp.fully_shard"
    )


class _NoFSDPState:
    """What ``torch.distributed.fsdp.fully_shard.state(m)`` returns for a blockshard module: the two
    entry points torch's pipelining drives ([Note: pipelining's gradient reduction]); any other
    attribute raises, naming blockshard's way ([Note: an FSDPModule])."""

    __slots__ = ("_module", "_text")

    def __init__(self, text: str, module: nn.Module) -> None:
        self._text = text
        self._module = weakref.ref(module)

    def _state(self) -> ModuleState:
        module = self._module()
        st = state_of(module) if module is not None else None
        if st is None:
            raise ShardingError(f"{self._text} (the module is gone or no longer sharded)")
        return st

    @property
    def _state_ctx(self) -> _PipelineContext:
        return _PipelineContext([_PipelineState(st) for st in self._state()._context().states])

    def _root_post_backward_final_callback(self) -> None:
        """After the reductions: reshard what reshards after backward, wait for every reduce-scatter
        (the sharded ``.grad`` are final when this returns, as at the end of a backward)."""
        context = self._state()._context()
        for st in context.states:
            if st.controls.reshard_after_backward:
                st.reshard()
        context.finish_reductions()

    def __getattr__(self, name: str) -> NoReturn:
        raise ShardingError(f"{self._text} (torch read FSDP2's state attribute {name!r})")


class _PipelineContext:
    """[Note: pipelining's gradient reduction]
    torch's pipelining schedules run every micro-batch's backward with gradient sync off, then call
    ``perform_reduce_grad``, which reaches into FSDP2's state: for each state of the stage's root,
    ``_state_ctx.all_states[i]._fsdp_param_groups[j].post_backward()`` (reduce-scatter what the
    micro-batches accumulated), then ``_root_post_backward_final_callback()``. For a blockshard
    module that state is this shim: ``post_backward`` is :meth:`ModuleState.reduce_accumulated` of
    each group under the root, the final callback waits for the reduce-scatters and reshards. The
    rest of FSDP2's state stays unreadable ([Note: an FSDPModule]).

    Zero-bubble schedules split each backward into an input pass (``torch.autograd.grad`` on the
    stage's inputs: no parameter gets a gradient) and a weight pass, which differentiates the
    parameters ``stage.submod.parameters()`` yields and assigns their ``.grad``. With
    ``reshard_after_forward=False`` those are the unsharded parameters the forward used, and the
    assigned gradients are added to what earlier micro-batches left ([Note: gradient views] in
    _grad_sync.py): bitwise as stock FSDP2. A group that reshards after forward yields its sharded
    pieces there, which are not in the graph, so no weight gradient is made at all (stock FSDP2 then
    steps those parameters without gradients, silently). ``post_backward`` refuses a group that a
    backward reached but where no parameter got a gradient, naming that fix."""

    __slots__ = ("all_states",)

    def __init__(self, states: list[_PipelineState]) -> None:
        self.all_states = states


class _PipelineState:
    __slots__ = ("_fsdp_param_groups",)

    def __init__(self, st: ModuleState) -> None:
        self._fsdp_param_groups = [_PipelineGroup(st)]


class _PipelineGroup:
    __slots__ = ("_st",)

    def __init__(self, st: ModuleState) -> None:
        self._st = st

    def post_backward(self) -> None:
        st = self._st
        if st.controls.requires_gradient_sync and any(b.reached_without_grads() for b in st.training_sets):
            raise ShardingError(
                f"torch's pipelining is about to reduce the gradients of blockshard group {st.name!r}, but none "
                "of its parameters got a gradient in this step, though its backward ran. That is what a "
                "zero-bubble schedule (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV) "
                "does with a stage whose groups reshard after forward: its weight pass differentiates "
                "stage.submod.parameters(), which are then the sharded pieces the forward did not use, so the "
                "weight gradients are lost (stock FSDP2 loses them silently). Fix: fully_shard the stage's "
                "modules with reshard_after_forward=False (torchtitan's default under pipelining), or use a "
                "schedule without a separate weight pass (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, "
                "ScheduleLoopedBFS)"
            )
        st.reduce_accumulated()


def mark_no_fsdp_state(module: nn.Module) -> None:
    """Give ``module`` the state ``fully_shard.state(module)`` returns: one that raises when read
    (but for pipelining's gradient reduction, [Note: pipelining's gradient reduction]), and put
    ``"fully_shard"`` in its composable-API registry, as torch's ``fully_shard`` does: torch's
    composable ``replicate`` over a model then leaves this module's parameters to blockshard (it
    would all-reduce the ranks' pieces, whose sizes differ by rank: gloo aborts), and refuses to
    replicate the module itself. Where torch keeps that state elsewhere than this release's
    ``contract`` does, nothing is stored and torch's own error stays (a ``None`` state)."""
    import importlib

    from torch.distributed.fsdp._fully_shard import _fully_shard as impl

    contract = importlib.import_module(
        "torch.distributed._composable.contract"
    )  # the package exports a function of that name
    func, key = getattr(impl.fully_shard, "__wrapped__", None), getattr(contract, "STATE_KEY", None)
    if func is None or not isinstance(key, str):
        return
    module.__dict__.setdefault(key, {})[func] = _NoFSDPState(not_fsdp_state(module), module)
    registry, item = getattr(contract, "REGISTRY_KEY", None), getattr(contract, "RegistryItem", None)
    if isinstance(registry, str) and item is not None:
        module.__dict__.setdefault(registry, OrderedDict()).setdefault(func.__name__, item())


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ShardingError(f"{name}={value!r} must be True or False")


def _prefetch_states(what: str, modules: Iterable[object]) -> list[ModuleState]:
    if isinstance(modules, nn.Module) or not isinstance(modules, Iterable):
        raise ShardingError(f"{what}(modules={modules!r}): pass a list of sharded modules")
    out = []
    for i, m in enumerate(modules):
        st = state_of(m) if isinstance(m, nn.Module) else None
        if st is None:
            raise ShardingError(
                f"{what}: modules[{i}] ({type(m).__name__}) is not sharded by blockshard.fully_shard; pass "
                "modules returned by fully_shard"
            )
        out.append(st)
    return out


def register_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` (e.g. ``generate``) run the engine's pre- and
    post-forward hooks, as ``forward`` does: FSDP2's ``register_fsdp_forward_method``."""
    st = state_of(module)
    if st is None:
        raise ShardingError(
            f"register_forward_method: this {type(module).__name__} is not sharded; call it on a module "
            "returned by blockshard.fully_shard"
        )
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ShardingError(
            f"register_forward_method: {type(module).__name__} has no method {method_name!r}; pass the name "
            "of a method it defines, e.g. 'generate'"
        )
    if getattr(method, "_blockshard_forward_method", False):
        return
    orig = method.__func__ if hasattr(method, "__func__") else method

    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = state_of(self)
        assert state is not None
        args, kwargs = state.pre_forward(self, args, kwargs)
        state.method_depth += 1  # forward calls inside the method nest in this pass
        try:
            out = orig(self, *args, **kwargs)
        finally:
            state.method_depth -= 1
        return state.post_forward(self, args, out)

    wrapped._blockshard_forward_method = True  # type: ignore[attr-defined]
    setattr(module, method_name, wrapped.__get__(module, type(module)))
