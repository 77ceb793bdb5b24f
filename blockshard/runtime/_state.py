"""Per-module state and the hooks that drive a step.

[Note: one step, phase by phase]
Forward, per sharded module in forward order:
  1. pre-forward: wait for (or issue) this group's all-gather; swap the module's parameters to
     the unsharded views; start the *next* group's all-gather (prefetch, in the order recorded
     in the previous step).
  2. post-forward: register a pre-backward hook on the outputs; reshard (free the gathered
     storage, swap back to sharded parameters) unless ``reshard_after_forward=False`` or this is
     the root and a backward follows.
Backward, in reverse:
  3. pre-backward (first gradient reaching the module's outputs): all-gather again if resharded,
     start counting the group's gradients, prefetch the group before this one.
  4. post-accumulate-grad hooks count this group's gradients; when all have arrived, the group
     reduce-scatters (unless gradient sync is off) and reshards.
  5. the root queues a final callback at its first pre-backward: it finishes every group whose
     count never completed (unused parameters) and reshards whatever is still unsharded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from blockshard.runtime._group import GroupState, ParamGroup

__all__ = ["RootContext", "ShardState", "register_hooks"]


@dataclass(eq=False)
class RootContext:
    """Shared by every state under one root: the forward order and the end-of-backward callback."""

    states: list[ShardState] = field(default_factory=list)
    forward_order: list[ShardState] = field(default_factory=list)
    last_order: list[ShardState] = field(default_factory=list)
    last_index: dict[int, int] = field(default_factory=dict)  # id(state) -> position in last_order
    callback_queued: bool = False

    def remember_order(self) -> None:
        """The forward order just recorded becomes the prefetch order of the next step."""
        self.last_order = self.forward_order
        self.last_index = {id(st): i for i, st in enumerate(self.last_order)}

    def neighbour(self, state: ShardState, step: int) -> ShardState | None:
        i = self.last_index.get(id(state))
        if i is None or not 0 <= i + step < len(self.last_order):
            return None
        return self.last_order[i + step]


@dataclass(eq=False)
class ShardState:
    module: nn.Module
    group: ParamGroup
    reshard_after_forward: bool
    param_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    is_root: bool | None = None  # decided at the first forward
    ctx: RootContext | None = None


def _lazy_init(root: ShardState, states_of) -> None:
    ctx = RootContext()
    for m in root.module.modules():
        st = states_of(m)
        if st is None:
            continue
        st.ctx = ctx
        st.is_root = st is root
        ctx.states.append(st)
    assert ctx.states[0] is root


def _cast(x, dtype):
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def register_hooks(state: ShardState, states_of) -> list:
    """Install the hooks of [Note: one step, phase by phase]; returns their handles."""
    module, group = state.module, state.group

    def pre_forward(_module, args, kwargs):
        if state.is_root is None:
            _lazy_init(state, states_of)
        ctx = state.ctx
        assert ctx is not None
        if state.is_root:
            if ctx.forward_order:
                ctx.remember_order()
            ctx.forward_order = []
        ctx.forward_order.append(state)
        group.wait_unshard()
        nxt = ctx.neighbour(state, +1)
        if nxt is not None:
            nxt.group.unshard(async_op=True)
        if state.param_dtype is not None and state.cast_forward_inputs:
            args, kwargs = tree_map(lambda x: _cast(x, state.param_dtype), (args, kwargs))
        return args, kwargs

    def post_forward(_module, _args, output):
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        backward_follows = torch.is_grad_enabled() and bool(tensors)
        if backward_follows:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda _grads: pre_backward(), mode="any")
        if not backward_follows or (state.reshard_after_forward and not state.is_root):
            group.reshard()
        if state.output_dtype is not None:
            output = tree_map(lambda x: _cast(x, state.output_dtype), output)
        return output

    def pre_backward():
        ctx = state.ctx
        assert ctx is not None
        if not ctx.callback_queued:
            ctx.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: final_callback(ctx))
        group.wait_unshard()
        if not group.backward_pending:
            group.prepare_grads()
        prev = ctx.neighbour(state, -1)
        if prev is not None:
            prev.group.unshard(async_op=True)

    def on_grad(_param):
        if group.backward_pending:
            group.num_grads_ready += 1
            if group.num_grads_ready == group.num_grads_expected:
                group.finish_backward()

    handles = [
        module.register_forward_pre_hook(pre_forward, with_kwargs=True),
        module.register_forward_hook(post_forward),
    ]
    for sp in group.params:
        if sp.requires_grad:
            handles.append(sp.unsharded.register_post_accumulate_grad_hook(on_grad))
    return handles


def final_callback(ctx: RootContext) -> None:
    ctx.callback_queued = False
    ctx.remember_order()
    for st in ctx.states:
        st.group.finish_backward()  # groups whose gradients never all arrived (unused params)
        if st.group.state is GroupState.UNSHARDED or st.group._pending:
            st.group.reshard()
