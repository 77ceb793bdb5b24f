"""``GradientSync``: the gradients of one ``ParamBuffers`` (its ``grads``): accumulation without
sync, the asynchronous reduce-scatter into the local gradient, and HSDP's all-reduce ([Note: buffers]
in _buffers.py). It owns the gradient state (the local gradient's weak reference, the reduction in
flight, HSDP's outputs not all-reduced yet) and reads the buffers, layout and controls of its
buffer set.

[Note: HSDP]
With a 2-D mesh ``(replicate, shard)``, as FSDP2's HSDP, the layout is planned over the shard
axis (each replica holds the whole model, sharded over its ``W_shard`` ranks), and a group's
gradients are reduce-scattered over the shard axis, then all-reduced over the replicate axis
(one all-reduce of the rank's segment per group): the average over all ranks (the sum, divided
by the divide factor, when one is set). ``set_requires_all_reduce(False)`` keeps the
reduce-scattered segment (summed across such backwards) without a ``.grad``; the next backward
that all-reduces adds it in, as FSDP2's partial reduce output.

[Note: async reduce-scatter]
As FSDP2's ``post_backward`` (``reduce_scatter_max_input_buffers=1``): when a group's backward is
over, ``reduce_grads`` packs its gradients and issues the reduce-scatter with ``async_op=True``;
the group's ``_Reduction`` keeps the input and output alive (on gloo only the output: the work
owns a copy of the input, [Note: gloo's copies] in _collectives.py). The next group's
post-backward first waits for it (``RootContext.finish_reductions``: so it ran during that
group's backward compute, and at most one reduce-scatter input is alive), and the final callback
waits for the last one: every sharded ``.grad`` is set, HSDP's all-reduce done, when
``backward()`` returns. Waits are
bounded ([Note: collective integrity]); the tally records the reduce-scatter when issued, the
all-reduce when done, the same on every rank. Measured on torch 2.13's gloo (the engine's own
group, ``test_fast_async_reduce.py``): ``reduce_scatter_single(async_op=True)`` returns before
the peer has issued its part, so the overlap is real on the CPU too; on NCCL it runs on the
reduce-scatter stream ([Note: streams] in _common.py). ``reset_iter_state`` drops a reduction in
flight with the step's gradients (:meth:`GradientSync.reset_step`).

[Note: gradient views]
The unsharded gradients are views into the reduce-scatter input ``rs_in`` [W * S], so the
reduce-scatter reads them where autograd wrote them, with no copy ("the gathered buffer is the
parameters", for gradients). ``prepare`` (at the group's pre-backward) puts a pre-hook on each
unsharded parameter's ``AccumulateGrad`` node (once per parameter object) whose dtype is the
reduce dtype. When the group's first gradient is about to be accumulated, the hook allocates
``rs_in`` zeroed (holes, frozen parameters and parameters that get no gradient send zeros); for
each parameter it then sets ``.grad`` to its view, in the gathered layout, and ``AccumulateGrad``
adds the gradient into it in place (as into any existing ``.grad``), across micro-batches without
sync too (``rs_in`` lives until the backward that reduces). Allocating at the first gradient, not
at pre-backward, keeps ``rs_in`` out of the start of backward, where the activations are all alive.
A gradient of another dtype (bf16 compute, fp32 reduce) is made by autograd on its own and added
into its view, cast on the fly, at the end of each backward (``_fold``: fp32 accumulation of bf16
micro-batches, as FSDP2's, without a copy); so is one whose hook did not run, and a gradient that
replaced its view (``backward(create_graph=True)`` accumulates out of place) is copied over it. A
view the hook did not hand out as ``.grad`` (made by ``_fold``) holds a sum of its own: a ``.grad``
set from outside autograd's accumulation (torch's pipelining assigns the weight pass's gradients,
[Note: pipelining's gradient reduction] in _module.py) is added into it, not copied over it.
A parameter that got no gradient has no view and keeps ``.grad = None``, as on one process. A
master in packed tile order is copied in (the copy permutes). Once the reduce-scatter is issued
the views are dropped and ``rs_in`` is freed (or kept for the wait where the backend reads it in
place).

Where it pays: the copy path holds a group's gradients and ``rs_in`` at once when the group's
backward ends (2x its gradient bytes), the views 1x. But the views take ``rs_in`` whole at the
group's first gradient, where autograd's own tensors come one by one, and gloo on the CPU clones
the input of every reduce-scatter (2x again, [Note: gloo's copies]): measured there
(docs/engine_benchmark.md, "Gradient views") the views cost peak memory and save none, so the
default (``GroupControls.gradient_views = None``, ``set_gradient_views``,
``BLOCKSHARD_GRADIENT_VIEWS``) turns them on only where the backend reduce-scatters in place.
"""

from __future__ import annotations

import os
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from blockshard._errors import BlockshardError
from blockshard.runtime.core._collectives import all_reduce_in_place, holds_copies, reduce_scatter_avg, wait

if TYPE_CHECKING:
    from blockshard.runtime.core._buffers import ParamBuffers
    from blockshard.runtime.core._param import ShardedParam

__all__ = ["VIEWS_ENV", "GradientSync", "gradient_views_default"]

VIEWS_ENV = "BLOCKSHARD_GRADIENT_VIEWS"


def gradient_views_default() -> bool | None:
    """[Note: gradient views] A new group's ``gradient_views`` from ``BLOCKSHARD_GRADIENT_VIEWS``:
    ``1`` on, ``0`` off, unset (or empty) None: on where the backend reduce-scatters in place."""
    raw = os.environ.get(VIEWS_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise BlockshardError(
            f"environment variable {VIEWS_ENV}={raw!r} must be 1 (unsharded gradients as views of the "
            "reduce-scatter input), 0 (copied into it) or unset (views where the backend reduce-scatters in "
            "place, e.g. NCCL), e.g. unset it"
        )
    return None if not raw else raw == "1"


class GradientSync:
    """The gradient state and collectives of one :class:`ParamBuffers` (``buffers``) with a layout."""

    def __init__(
        self, buffers: ParamBuffers, reduce_dtype: torch.dtype, replicate_group: dist.ProcessGroup | None
    ) -> None:
        self.buffers = buffers
        self.reduce_dtype = reduce_dtype
        self.replicate_group = replicate_group  # HSDP ([Note: HSDP]): the replicate axis
        self._grad: weakref.ref[torch.Tensor] | None = None  # the local gradient [S] while a .grad views it
        self._partial: torch.Tensor | None = None  # HSDP: reduce-scatter outputs not all-reduced yet
        self._reduction: _Reduction | None = None  # the reduce-scatter in flight ([Note: async reduce-scatter])
        self._rs_in: torch.Tensor | None = None  # [W*S] while unsharded gradients view it ([Note: gradient views])
        self._views: dict[int, torch.Tensor] = {}  # layout index -> the gradient view set on its unsharded param
        self._handed: set[int] = set()  # layout indices whose view is their unsharded param's .grad (set by the hook)
        self._watching = False  # this backward's views are on (read once, at the group's pre-backward)
        self._reached = False  # a backward reached the group since its last reduction (``prepare`` ran)

    def grad_buffer(self) -> torch.Tensor | None:
        """The local gradient [S] while some sharded ``.grad`` views it, else None ([Note: buffers])."""
        return None if self._grad is None else self._grad()

    def forget_grad_buffer(self) -> None:
        """The buffers moved (``materialize``): a gradient buffer of the old ones is not ours any more."""
        self._grad = None

    def _new_grad_buffer(self) -> torch.Tensor:
        # not zeroed: only the pieces the reduce-scatter wrote are ever viewed
        b = self.buffers
        buf = torch.empty(b.local.numel(), dtype=b.orig_dtype, device=b.host, pin_memory=b.streams.pinned)
        self._grad = weakref.ref(buf)
        return buf

    def _adopt_grad_buffer(self, rs_in: torch.Tensor) -> torch.Tensor:
        """[Note: one rank] On one rank the reduce-scatter input [S] (in the local layout, the
        parameters' dtype, made for this reduction) is the local gradient: it becomes the gradient
        buffer, and the reduce-scatter (a copy onto itself) copies nothing."""
        self._grad = weakref.ref(rs_in)
        return rs_in

    def views_on(self) -> bool:
        """Whether this backward's gradients go into views ([Note: gradient views])."""
        b = self.buffers
        chosen = b.controls.gradient_views
        return not holds_copies(b.process_group, b.device) if chosen is None else chosen

    def prepare(self) -> None:
        """[Note: gradient views] Watch every eligible unsharded parameter (once per parameter object)."""
        self._reached = True
        self._watching = self.buffers.layout is not None and self.views_on()
        if self._watching:
            for sp in self.buffers.params:
                if sp.order is None and sp.tp is None and sp.unsharded.dtype == self.reduce_dtype:
                    sp.watch_grad(self._grad_arrival)

    def _view(self, sp: ShardedParam) -> torch.Tensor:
        """``sp``'s gradient view (its shape, the reduce dtype) of the reduce-scatter input, allocated
        zeroed at the group's first."""
        if self._rs_in is None:
            b = self.buffers
            self._rs_in = torch.zeros(b.gathered.numel(), dtype=self.reduce_dtype, device=b.device)  # [W*S]
        view = self._rs_in[sp.gathered_offset : sp.gathered_offset + sp.numel].view(sp.shape)
        self._views[sp.index] = view
        return view

    def _view_of(self, sp: ShardedParam) -> torch.Tensor:
        """``sp``'s gradient view, made if it has none yet."""
        return self._views[sp.index] if sp.index in self._views else self._view(sp)

    def _grad_arrival(self, sp: ShardedParam) -> None:
        """A gradient is about to be accumulated into ``sp.unsharded``: point its ``.grad`` at its view."""
        view = self._views.get(sp.index)
        if (view is not None and sp.unsharded.grad is view) or not self._watching:
            return
        grad, view = sp.unsharded.grad, self._view_of(sp)
        if grad is not None:
            if sp.index in self._handed:  # replaced its view out of place (create_graph): holds the sum
                view.copy_(grad)
            else:  # set outside autograd's accumulation (a weight pass), or from before its view: added in
                view.add_(grad)
        sp.unsharded.grad = view
        self._handed.add(sp.index)

    def _fold(self) -> None:
        """Views on: add each row-major gradient autograd made on its own (another dtype than the
        reduce dtype, or a hook missed) into its view, cast on the fly, and drop it."""
        for sp in self.buffers.params:
            if sp.order is not None:
                continue
            if sp.accumulated is not None:  # summed while views were off (set_gradient_views in between)
                self._view_of(sp).add_(sp.accumulated)
                sp.accumulated = None
            grad, view = sp.local_grad(), self._views.get(sp.index)
            if grad is None or grad is view:
                continue
            if view is not None and sp.index in self._handed and grad.dtype == view.dtype:
                view.copy_(grad)  # replaced its view out of place (create_graph): holds the sum
            else:  # made on its own, or set from outside autograd's accumulation: what the view holds is kept
                self._view_of(sp).add_(grad)
            sp.unsharded.grad = None
            self._handed.discard(sp.index)

    def accumulate(self) -> None:
        """Backward without gradient sync: keep the unsharded gradients for the next backward, in
        the reduce dtype when it differs from the parameters' (as FSDP2 does: bf16 micro-batch
        gradients summed in fp32), in their views when views are on ([Note: gradient views])."""
        if self.views_on():
            self._fold()
            return
        if self.reduce_dtype == self.buffers.param_dtype:
            return  # autograd accumulates into the unsharded .grad by itself
        for sp in self.buffers.params:
            grad = sp.local_grad()
            if grad is None:
                continue
            if sp.accumulated is None:
                sp.accumulated = grad.to(self.reduce_dtype)
            else:
                sp.accumulated += grad
            sp.unsharded.grad = None

    def _packed(self) -> tuple[torch.Tensor, set[int]]:
        """The reduce-scatter input [W*S] and the layout indices of the parameters with a gradient.

        Views ([Note: gradient views]) are already in place; every other gradient is copied in, in
        the gathered layout (cast to the reduce dtype, as FSDP2's ``chunk_cat``), and freed right
        after. Holes and parameters without a gradient send zeros. A parameter without a gradient
        here is taken to have none on any rank (as FSDP2 assumes): it keeps ``.grad = None``, so
        the optimizer skips it as it would on one process."""
        b = self.buffers
        if self.views_on():
            self._fold()
        rs_in, views, self._rs_in, self._views = self._rs_in, self._views, None, {}
        self._handed.clear()
        self._reached = False
        zeroed = rs_in is not None  # made by the views, zeroed; else every gradient is copied in
        if rs_in is None:
            rs_in = torch.empty(b.gathered.numel(), dtype=self.reduce_dtype, device=b.device)  # [W*S]
            for lo, hi in b.holes:
                rs_in[lo:hi].zero_()
        has_grad = set(views)
        for sp in b.params:
            if sp.index in views:  # accumulated in place
                sp.unsharded.grad = None
                continue
            dst = rs_in[sp.gathered_offset : sp.gathered_offset + sp.stored_numel]
            grad, acc = sp.local_grad(), sp.accumulated
            if acc is not None:  # micro-batches accumulated without sync, in the reduce dtype
                if grad is not None:
                    acc += grad
                grad, sp.accumulated = acc, None
            if grad is None:
                if not zeroed:
                    dst.zero_()
                continue
            if sp.order is not None:  # stored in another order: the copy permutes (zeros in its padding)
                sp.order.take_into(dst, grad.reshape(-1), 0)
            else:
                dst.copy_(grad.reshape(-1))
            sp.unsharded.grad = None
            has_grad.add(sp.index)
        return rs_in, has_grad

    def reduce(self) -> None:
        """Issue the reduce-scatter (average) of the unsharded gradients (:meth:`_packed`) into the
        local gradient, asynchronously: :meth:`finish` waits and sets the sharded ``.grad``
        ([Note: async reduce-scatter])."""
        self.finish()  # one reduction in flight per buffer set
        b = self.buffers
        layout, W = b.layout, b.world_size
        assert layout is not None
        rs_in, has_grad = self._packed()
        # Straight into a new gradient buffer unless a sharded grad must be accumulated into (the
        # user kept .grad across steps), the reduce dtype differs from the parameters' or the
        # local gradient lives elsewhere (offload). Never into a buffer still alive without our
        # pieces: the user may hold an old .grad.
        accumulate = any(sp.sharded.grad is not None for sp in b.params)
        direct = not accumulate and self.reduce_dtype == b.orig_dtype and not b.offload
        S = b.local.numel()
        buf: torch.Tensor | None
        if direct and W == 1 and rs_in.is_contiguous():
            buf = self._adopt_grad_buffer(rs_in)  # [Note: one rank]: the input is the reduced gradient
        else:
            buf = self._new_grad_buffer() if direct else self.grad_buffer() if accumulate else None
        out = buf if direct else torch.empty(S, dtype=self.reduce_dtype, device=b.device)
        assert out is not None
        b.agree(f"the reduce-scatter of group {b.described}", S, self.reduce_dtype)  # [Note: collective headers]
        b.count(1)
        works, moved = [], 0
        with b.streams.on("reduce_scatter"):  # [Note: streams]
            for k, S_k in enumerate(layout.buckets):
                off = layout.bucket_local_offset(k)
                unreduced = rs_in[W * off : W * (off + S_k)]
                works.append(
                    reduce_scatter_avg(
                        out[off : off + S_k],
                        unreduced,
                        b.process_group,
                        async_op=True,
                        summed=self._summed,
                    )
                )
                moved += unreduced.numel() * unreduced.element_size()
        planned = layout.padded_numel * self.reduce_dtype.itemsize
        b.sent(1, moved, planned, rs_in.dtype)  # [Note: traffic]
        # gloo reduce-scatters a copy of its input that the work owns: ours is not read again,
        # so it is freed now, not while the next group's backward runs ([Note: gloo's copies])
        keep = None if holds_copies(b.process_group, rs_in.device) else rs_in
        del rs_in
        self._reduction = _Reduction(works, keep, out, buf, direct, has_grad)

    @property
    def reducing(self) -> bool:
        """A reduce-scatter is in flight (issued, not waited for)."""
        return self._reduction is not None

    def reset_step(self) -> None:
        """Forget what an interrupted step left (``reset_iter_state``): HSDP's outputs not
        all-reduced yet and a reduction in flight, whose gradients are lost with the step (the
        collective itself still completes in the background)."""
        self._partial = None
        self._reduction = None
        self._rs_in, self._views, self._watching = None, {}, False
        self._handed.clear()
        self._reached = False

    def reached_without_grads(self) -> bool:
        """A backward reached this group since its last reduction, and none of its parameters got a
        gradient (checked before torch's pipelining reduces: [Note: pipelining's gradient reduction])."""
        return (
            self._reached
            and not self._views
            and all(sp.local_grad() is None and sp.accumulated is None for sp in self.buffers.params)
        )

    def finish(self) -> None:
        """Wait for the reduce-scatter in flight (bounded, [Note: collective integrity]), free its
        input, all-reduce across replicas (HSDP) and point the sharded ``.grad`` at the result."""
        red, self._reduction = self._reduction, None
        if red is None:
            return
        b = self.buffers
        for work in red.works:
            wait(work, f"the reduce-scatter of group {b.described}", b.process_group)
        b.streams.current_waits("reduce_scatter")
        out, buf, direct, has_grad = red.out, red.buf, red.direct, red.has_grad
        del red  # the works (gloo: with their copy of the input) and the input, if kept, are freed here
        if self.replicate_group is not None and not self._all_reduce(out):
            return  # set_requires_all_reduce(False): kept for the next all-reduce, no .grad yet
        self._hook(out)
        factor = self._divide_factor()
        if factor is not None:
            out.div_(factor)
        unused = b.controls.reduce_scatter_unused_params  # [Note: communication controls] in _module_comms.py
        for sp in b.params:
            if not sp.sharded.requires_grad or (sp.index not in has_grad and not unused):
                continue
            lo, hi = sp.local_offset, sp.local_offset + sp.local_numel
            if sp.sharded.grad is None:
                if not direct:
                    if buf is None:
                        buf = self._new_grad_buffer()
                    buf[lo:hi].copy_(out[lo:hi], non_blocking=b.streams.pinned)  # offload: to the host
                assert buf is not None
                sp.sharded.grad = buf[lo:hi].view(sp.sharded.shape)
            else:
                sp.sharded.grad += out[lo:hi].view(sp.sharded.shape).to(sp.sharded.grad.device, b.orig_dtype)
        b.streams.host_copies_done()

    @property
    def _summed(self) -> bool:
        """Whether the collectives sum and the engine divides (a divide factor, or FSDP2's
        ``set_force_sum_reduction_for_comms``)."""
        return self.buffers.controls.divide_factor is not None or self.buffers.controls.force_sum

    def _divide_factor(self) -> float | None:
        """What the summed output is divided by: the factor set, else every data-parallel rank."""
        controls = self.buffers.controls
        if controls.divide_factor is not None or not controls.force_sum:
            return controls.divide_factor
        replicas = 1 if self.replicate_group is None else self.replicate_group.size()
        return float(self.buffers.world_size * replicas)

    def _hook(self, out: torch.Tensor) -> None:
        """FSDP2's all-reduce hook on the reduced output ([Note: communication controls])."""
        controls = self.buffers.controls
        if controls.all_reduce_hook is None:
            return
        with torch.cuda.stream(controls.all_reduce_hook_stream) if controls.all_reduce_hook_stream else nullcontext():
            controls.all_reduce_hook(out)

    def _all_reduce(self, out: torch.Tensor) -> bool:
        """[Note: HSDP] Average (sum, with a divide factor) ``out`` over the replicate axis, adding
        the outputs kept while ``requires_all_reduce`` was off; False while it is off."""
        if self._partial is not None:
            out += self._partial
        b = self.buffers
        if not b.controls.requires_all_reduce:
            self._partial = out  # no .grad views it: the next reduce-scatter adds it in
            return False
        self._partial = None
        pg = self.replicate_group
        assert pg is not None
        op = dist.ReduceOp.SUM if self._summed else dist.ReduceOp.AVG
        b.agree(f"the all-reduce of group {b.described}", out.numel(), out.dtype, pg)
        b.count(2)
        assert b.layout is not None
        planned = b.layout.segment_numel * self.reduce_dtype.itemsize
        b.sent(2, out.numel() * out.element_size(), planned, out.dtype)  # [Note: traffic]
        all_reduce_in_place(out, op, pg, f"the all-reduce of group {b.described}")
        return True


@dataclass(eq=False)
class _Reduction:
    """A group's reduce-scatter in flight: its works, and its input kept alive until the wait
    (but on gloo, whose works own a copy of it: [Note: gloo's copies])."""

    works: list[dist.Work]
    rs_in: torch.Tensor | None  # [W*S], reduce dtype; None where the backend copied it (gloo)
    out: torch.Tensor  # [S], reduce dtype: the local gradient itself when ``direct``
    buf: torch.Tensor | None  # the local gradient to point .grad at (None: allocated when needed)
    direct: bool
    has_grad: set[int]
