"""Per-module state and the hooks that drive a step: the engine's state machine.

[Note: one step, phase by phase]
Forward, per sharded module in forward order (:class:`TrainingState` IDLE -> FORWARD -> IDLE):
  1. pre-forward: wait for (or issue) this group's all-gather; the module now holds the
     unsharded views; start the *next* group's all-gather (prefetch, in the order recorded in the
     previous step).
  2. post-forward: register a pre-backward hook on the outputs; reshard (free the gathered
     storage, swap back to sharded parameters) unless ``reshard_after_forward`` says to keep them
     (``False``; ``None``, the default: the root keeps them) and a backward follows; an int keeps
     this rank's run of a smaller world ([Note: reshard to a smaller world] in _post_forward.py).
Backward, in reverse (IDLE -> PRE_BACKWARD -> POST_BACKWARD):
  3. pre-backward (first gradient reaching the module's outputs): all-gather again if resharded,
     prefetch the group before this one.
  4. post-backward ([Note: post-backward]): when the gradients of the module's inputs are
     computed, its backward is over: the group reshards (unless ``set_reshard_after_backward(False)``)
     and reduce-scatters (unless gradient sync is off: then it keeps the unsharded gradients, in the
     reduce dtype).
  5. the first pre-backward of a step queues a final callback: it finishes every group still in
     its backward (first layers, whose inputs need no gradient; unused parameters), reshards
     whatever is still unsharded (but groups told not to reshard after backward), sets every state back to IDLE and keeps this step's forward
     order for the next step's prefetch.

[Note: post-backward]
A group may reshard and reduce only when nothing in backward needs its parameters any more.
Counting the gradients of its trainable parameters is not enough: a frozen weight (LoRA's base
layer) is still needed for the input gradient after the last trainable gradient arrived. So, as
FSDP2 does, each forward call with grad enabled hooks the gradients of its *inputs* (every tensor
in args and kwargs, dataclass fields included, that requires grad; ``mode="all"``): they come
last in the module's backward (autograd runs a parameter's gradient accumulation as soon as it is
ready). A module called k times in one step finishes after the k-th such hook. A call whose
inputs need no gradient (a first layer fed token ids) cannot tell when its backward ends: the
group then finishes in the final callback. Which parameters require grad is read from the
sharded parameters (what ``model.parameters()`` yields) at every unshard, so freezing or
unfreezing before or after ``fully_shard``, or between steps, takes effect at the next forward.

[Note: recompute]
Under activation checkpointing (``torch.utils.checkpoint``, either mode) a module's forward runs
a second time *inside* backward to rebuild its activations. That recompute is not a new step: it
must not record forward order, prefetch the next group (already resharded after its backward)
or reshard its own group (its backward needs the parameters right away). The hooks detect it
with :func:`in_backward` and only make sure the group is unsharded; the module's pre-backward
and post-backward then proceed as without checkpointing, so a step issues as many all-gathers
with checkpointing as without. A *reentrant* checkpoint ran the original forward without grad
(so no pre-backward hook was registered then) and backpropagates through the recompute itself:
a module still IDLE in backward hooks the recomputed outputs instead (under a non-reentrant
checkpoint those outputs never receive a gradient, so the hook never fires).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from blockshard.runtime.core._added import check_no_added_parameters, registrations
from blockshard.runtime.core._buffer_set import BufferSet, GroupControls
from blockshard.runtime.core._buffers import ParamBuffers
from blockshard.runtime.core._common import TrainingState, eager, expect, in_backward, tensors_in
from blockshard.runtime.core._dtypes import check_trainable_dtypes
from blockshard.runtime.core._root import RootContext

__all__ = ["STATE_ATTR", "ModuleState", "state_of"]

#: The attribute of a sharded module that holds its :class:`ModuleState`.
STATE_ATTR = "_blockshard_state"


def state_of(module: nn.Module) -> ModuleState | None:
    """The :class:`ModuleState` of a module that ``fully_shard`` sharded, else ``None``."""
    state = module.__dict__.get(STATE_ATTR)
    return state if isinstance(state, ModuleState) else None


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward tells the module that its backward is over.

    Its outputs replace the inputs, so the gradient reaches the previous module's outputs (and its
    pre-backward) only after this runs: a group reshards before the one before it is gathered.
    """

    @staticmethod
    def forward(ctx: Any, state: ModuleState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state._inputs_done(grads)
        return (None, *grads)


def _cast(x: object, dtype: torch.dtype) -> object:
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


class ModuleState:
    """The state of one sharded module: its group (``buffers``, the primary buffer set, and
    ``buffer_sets``, every one in order: [Note: buffer sets]), its :class:`TrainingState` and its hooks."""

    def __init__(
        self,
        module: nn.Module,
        buffers: ParamBuffers,
        *,
        reshard_after_forward: bool | int | None,
        param_dtype: torch.dtype | None = None,
        output_dtype: torch.dtype | None = None,
        cast_forward_inputs: bool = True,
        modules: tuple[nn.Module, ...] | None = None,
        buffer_sets: Sequence[BufferSet] = (),
    ) -> None:
        # [Note: a list of modules] ``modules``: those the group's hooks are on (``fully_shard([a, b])``);
        # ``module``: the one its tensor names are relative to (for a list, their lowest common
        # ancestor once known, see _list_groups.py)
        self.module, self.buffers = module, buffers
        # every buffer set of the group, the primary among them, in the order of their collectives
        self.buffer_sets: list[BufferSet] = list(buffer_sets) or [buffers]
        if not any(b is buffers for b in self.buffer_sets):
            raise AssertionError(f"group {buffers.name!r}: the primary buffer set is not among buffer_sets")
        self.controls: GroupControls = buffers.controls  # FSDP2's controls, shared with the buffer sets
        self.modules: tuple[nn.Module, ...] = modules or (module,)
        self.method_depth = 0  # inside a register_forward_method method (generate): forwards nest in it
        # None: True but for the root (FSDP2's default); an int k: True, to k ranks ([Note: reshard to a smaller world])
        self.reshard_after_forward = reshard_after_forward
        # set_modules_to_forward_prefetch / _backward_prefetch: None = the recorded order's neighbour
        self.forward_prefetch: list[ModuleState] | None = None
        self.backward_prefetch: list[ModuleState] | None = None
        self.is_last_backward = True  # FSDP2's flag: nothing waits past backward here (_module.py)
        self.unshard_in_backward = True  # False (FSDP2's, e.g. an embedding): backward gathers nothing
        self.param_dtype, self.output_dtype = param_dtype, output_dtype
        self.cast_forward_inputs = cast_forward_inputs
        self.is_root: bool | None = None  # decided at the first forward
        self.ctx: RootContext | None = None
        self.balanced = False  # whether its layout took part in cost balancing ([Note: cost tally])
        self.ignored_ids: frozenset[int] = frozenset()  # ignored_params: [Note: parameters added after fully_shard]
        self.order = 0  # position among fully_shard calls ([Note: cost tally] in _api.py)
        # inside an enclosing sharded module's ``_apply`` (``model.to_empty``), which handles this
        # state's groups (ShardedModule._apply): on the state, so two thread ranks never share it
        self.applying = False
        self._to_idle()  # the per-step flags
        self._module_hooks = [
            hook
            for m in self.modules
            for hook in (
                m.register_forward_pre_hook(eager(self.pre_forward), with_kwargs=True),
                m.register_forward_hook(eager(self.post_forward)),
            )
        ]

    @property
    def name(self) -> str:
        """The group's name (its module's class name; a list's: ``[A, B]``)."""
        return self.buffers.name

    @property
    def param_buffers(self) -> list[ParamBuffers]:
        """The buffer sets that hold parameters as views (the primary, other dtypes, quantized gather)."""
        return [b for b in self.buffer_sets if isinstance(b, ParamBuffers)]

    @property
    def extra_param_buffers(self) -> list[ParamBuffers]:
        """Those beside the primary (other dtypes, quantized gather), each read as a group of its
        own by state dicts and checkpoints ([Note: mixed dtypes] in _dtypes.py)."""
        return [b for b in self.param_buffers if b is not self.buffers]

    def _end_pass(self) -> None:
        """Forget this forward pass's modules (a pass ends at the last of them, [Note: a list of modules])."""
        self._to_run: set[int] = set()  # ids of this pass's modules that have not run forward yet
        self._backward_follows = False  # some module of this pass hooked its outputs for backward

    def _to_idle(self) -> None:
        """IDLE, with every per-step flag reset: the one place they are (the end of a backward, of
        a forward without one, or of an interrupted step)."""
        self.training_state = TrainingState.IDLE
        self._end_pass()
        # [Note: post-backward] forward calls of this step whose inputs' gradients are pending
        self._inputs_pending = 0
        self._finish_at_end = False  # a call whose inputs need no gradient: finish in the final callback

    # -- forward ----------------------------------------------------------------------------------
    def _lazy_init(self) -> RootContext:
        """At the first forward, the module that runs first is the root: it owns the context."""
        ctx = RootContext()
        seen: set[int] = set()
        for top in self.modules:
            for path, m in top.named_modules():
                st = state_of(m)
                if st is not None and id(st) not in seen:
                    seen.add(id(st))
                    st.ctx, st.is_root = ctx, st is self
                    for g in st.buffer_sets:
                        g.path, g.tally, g.tally_index = path, ctx.tally, sum(len(o.buffer_sets) for o in ctx.states)
                        g.root = weakref.ref(ctx)
                    ctx.states.append(st)
        return ctx

    def _context(self) -> RootContext:
        if self.ctx is None:
            raise AssertionError(f"group {self.name!r} runs before its root initialized it")
        return self.ctx

    def _cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if self.param_dtype is None or not self.cast_forward_inputs:
            return args, kwargs
        dtype = self.param_dtype
        cast_args: tuple[Any, Any] = tree_map(lambda x: _cast(x, dtype), (args, kwargs))
        return cast_args

    def pre_forward(self, _module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if in_backward():  # [Note: recompute]
            self.unshard()
            if self.training_state is TrainingState.IDLE and not self._inputs_pending:
                args, kwargs = self._hook_inputs(args, kwargs)  # reentrant: the original forward had no grad
            return self._cast_inputs(args, kwargs)
        if self.training_state is TrainingState.FORWARD and (len(self.modules) > 1 or self.method_depth):
            # [Note: a list of modules] a later module of this group's pass, or a forward inside a
            # registered method (generate calls forward per token): gathered already
            self.unshard()
            if torch.is_grad_enabled():
                args, kwargs = self._hook_inputs(args, kwargs)
            return self._cast_inputs(args, kwargs)
        if self.is_root is None:
            self._lazy_init()
        ctx = self._context()
        if self.is_root:
            if ctx.registrations_seen != registrations():  # [Note: parameters added after fully_shard]
                check_no_added_parameters(ctx.states, self._averaged_over())
                ctx.registrations_seen = registrations()
            self._reset_if_interrupted(ctx)
            ctx.remember_order()
            ctx.tally.forward_started()  # [Note: collective headers]
        expect(f"pre-forward of group {self.name!r}", self.training_state, TrainingState.IDLE)
        for b in self.buffer_sets:
            b.check_forward()
        check_trainable_dtypes(self.buffers, self.param_buffers)  # [Note: mixed dtypes]
        self.training_state = TrainingState.FORWARD
        self._to_run = {id(m) for m in self.modules}
        ctx.forward_order.append(self)
        self.unshard()
        for nxt in self._prefetch(ctx, self.forward_prefetch, +1):
            nxt.unshard(async_op=True)
        if torch.is_grad_enabled():
            args, kwargs = self._hook_inputs(args, kwargs)
        return self._cast_inputs(args, kwargs)

    def _averaged_over(self) -> int:
        """The ranks a gradient of this group is averaged over (its shard group, times HSDP's replicas)."""
        replicas = self.buffers.replicate_group
        return self.buffers.world_size * (replicas.size() if replicas is not None else 1)

    def unshard(self, *, async_op: bool = False) -> None:
        """All-gather every buffer set of the group (issued together, then waited for)."""
        for g in self.buffer_sets:
            g.unshard(async_op=True)
        if not async_op:
            for g in self.buffer_sets:
                g.wait_unshard()

    def wait_unshard(self) -> None:
        for g in self.buffer_sets:
            g.wait_unshard()

    @property
    def training_sets(self) -> list[BufferSet]:
        """The buffer sets whose gradients this backward reduces ([Note: buffer sets])."""
        return [b for b in self.buffer_sets if b.trains]

    def reshard(self) -> None:
        for g in self.buffer_sets:
            g.reshard()

    def _hook_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Route the inputs that require grad through :class:`_PostBackward` (see
        [Note: post-backward]); inputs inside dataclasses get a gradient hook instead."""
        leaves, spec = tree_flatten((args, kwargs))
        slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        nested = [t for x in leaves if not isinstance(x, torch.Tensor) for t in tensors_in(x) if t.requires_grad]
        if not slots and not nested:
            self._finish_at_end = True
            return args, kwargs
        if nested:
            self._inputs_pending += 1
            torch.autograd.graph.register_multi_grad_hook(nested, self._inputs_done, mode="all")
        if slots:
            self._inputs_pending += 1
            routed = _PostBackward.apply(self, *(leaves[i] for i in slots))  # type: ignore[no-untyped-call]  # torch's Function.apply is unannotated
            for i, t in zip(slots, routed, strict=True):
                leaves[i] = t
        routed_args: tuple[Any, Any] = tree_unflatten(leaves, spec)
        return routed_args

    def _inputs_done(self, _grads: Any) -> None:
        self._inputs_pending -= 1
        if self._inputs_pending == 0 and not self._finish_at_end and self.training_state is TrainingState.PRE_BACKWARD:
            self.finish_backward()

    def _prefetch(self, ctx: RootContext, chosen: list[ModuleState] | None, step: int) -> list[ModuleState]:
        if chosen is not None:
            return chosen
        nb = ctx.neighbour(self, step)
        return [] if nb is None else [nb]

    def _reshards_after_forward(self) -> bool:
        """``None``: all but the root; an int (a smaller world, [Note: reshard to a smaller world]): yes."""
        return not self.is_root if self.reshard_after_forward is None else bool(self.reshard_after_forward)

    def _reshard_after_forward(self) -> None:
        """Reshard after a forward that a backward follows: to the ``k``-group's runs under an int
        ``reshard_after_forward`` ([Note: reshard to a smaller world] in _post_forward.py), else fully."""
        smaller = not isinstance(self.reshard_after_forward, bool) and isinstance(self.reshard_after_forward, int)
        for g in self.buffer_sets:
            if smaller and isinstance(g, ParamBuffers):
                g.reshard_after_forward()
            else:
                g.reshard()

    def _reset_if_interrupted(self, ctx: RootContext) -> None:
        """A backward that raised midway leaves states behind: drop its partial gradients."""
        if ctx.callback_queued or any(st.training_state is not TrainingState.IDLE for st in ctx.states):
            ctx.reset_step()

    def post_forward(self, module: nn.Module, _args: Any, output: Any) -> Any:
        if in_backward():  # [Note: recompute]
            if self.training_state is TrainingState.IDLE:
                self._hook_outputs(output)  # a reentrant checkpoint backpropagates through these
        else:
            expect(f"post-forward of group {self.name!r}", self.training_state, TrainingState.FORWARD)
            self._backward_follows |= self._hook_outputs(output)
            if not self.method_depth:  # a forward nested in a registered method: the method finishes
                self._to_run.discard(id(module))
            if not self._to_run:  # the last of the group's modules to run in this pass
                self._finish_forward()
                if self.is_root:  # modules of a list group that did not run: done ([Note: a list of modules])
                    for st in self._context().states:
                        if st.training_state is TrainingState.FORWARD and st is not self:
                            st._finish_forward()
        if self.output_dtype is not None:
            dtype = self.output_dtype
            output = tree_map(lambda x: _cast(x, dtype), output)
        return output

    def _finish_forward(self) -> None:
        if not self._backward_follows:
            self.reshard()
        elif self._reshards_after_forward():
            self._reshard_after_forward()
        self.training_state = TrainingState.IDLE
        self._end_pass()  # its backward's flags stay until the final callback

    def _hook_outputs(self, output: Any) -> bool:
        """Run :meth:`pre_backward` when the first gradient reaches ``output``; False if none will."""
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if not (torch.is_grad_enabled() and tensors):
            return False
        torch.autograd.graph.register_multi_grad_hook(tensors, self.pre_backward, mode="any")
        return True

    # -- backward ---------------------------------------------------------------------------------
    def pre_backward(self, _grad: torch.Tensor | None = None) -> None:
        """The first gradient reached this module's outputs (its other outputs' hooks return)."""
        partial = self.training_state is TrainingState.FORWARD and len(self.modules) > 1  # a list's pass cut short
        if self.training_state is not TrainingState.IDLE and not partial:
            return  # the module ran more than once in forward: one pre-backward per step
        ctx = self._context()
        if not ctx.callback_queued:
            ctx.callback_queued = True
            ctx.tally.backward_started()  # [Note: collective headers]
            torch.autograd.Variable._execution_engine.queue_callback(ctx.final_callback)
        self.training_state = TrainingState.PRE_BACKWARD
        for b in self.training_sets:
            b.prepare_grads()  # [Note: gradient views] in _grad_sync.py
        if self.unshard_in_backward:
            self.unshard()
        earlier = [st for st in self._prefetch(ctx, self.backward_prefetch, -1) if st.unshard_in_backward]
        for prev in earlier:
            prev.unshard(async_op=True)
        for prev in earlier:  # gloo: not in flight during this backward ([Note: gloo's copies])
            if any(b.gathers_on_copies for b in prev.buffer_sets):
                prev.wait_unshard()

    def reduce_accumulated(self) -> None:
        """Issue the reduce-scatter of the gradients accumulated without sync, outside a backward
        (FSDP2's ``FSDPParamGroup.post_backward()`` as torch's pipelining calls it after the last
        micro-batch: [Note: pipelining's gradient reduction] in _module.py). Without sync on, the
        gradients stay accumulated, as in :meth:`finish_backward`."""
        expect(f"the gradient reduction of group {self.name!r}", self.training_state, TrainingState.IDLE)
        if not self.controls.requires_gradient_sync:
            return
        ctx = self._context()
        ctx.finish_reductions()  # one reduction in flight per buffer set
        for b in self.training_sets:
            b.reduce_grads()
            if b.reducing:
                ctx.reducing.append(b)

    def finish_backward(self) -> None:
        """All gradients are in: reshard, then issue the reduce-scatter unless accumulating
        without sync ([Note: async reduce-scatter])."""
        expect(f"post-backward of group {self.name!r}", self.training_state, TrainingState.PRE_BACKWARD)
        self.training_state = TrainingState.POST_BACKWARD
        if self.controls.reshard_after_backward:
            self.reshard()  # free the gathered parameters before the reduce-scatter needs its output
        if not self.controls.requires_gradient_sync:
            for b in self.training_sets:
                b.accumulate_grads()
            return
        ctx = self._context()
        ctx.finish_reductions()  # the previous group's, which overlapped this group's backward
        for b in self.training_sets:
            b.reduce_grads()
            if b.reducing:
                ctx.reducing.append(b)
