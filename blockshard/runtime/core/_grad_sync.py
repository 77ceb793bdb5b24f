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
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from blockshard.runtime.core._collectives import holds_copies, reduce_scatter_avg, wait

if TYPE_CHECKING:
    from blockshard.runtime.core._buffers import ParamBuffers

__all__ = ["GradientSync"]


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

    def accumulate(self) -> None:
        """Backward without gradient sync: keep the unsharded gradients for the next backward, in
        the reduce dtype when it differs from the parameters' (as FSDP2 does: bf16 micro-batch
        gradients summed in fp32)."""
        if self.reduce_dtype == self.buffers.param_dtype:
            return  # autograd accumulates into the unsharded .grad by itself
        for sp in self.buffers.params:
            grad = sp.unsharded.grad
            if grad is None:
                continue
            if sp.accumulated is None:
                sp.accumulated = grad.to(self.reduce_dtype)
            else:
                sp.accumulated += grad
            sp.unsharded.grad = None

    def reduce(self) -> None:
        """Pack the unsharded gradients and issue their reduce-scatter (average) into the local
        gradient, asynchronously: :meth:`finish` waits and sets the sharded ``.grad``
        ([Note: async reduce-scatter]).

        Gradients are packed into the reduce-scatter input in the gathered layout (one copy, cast
        to the reduce dtype, as FSDP2's ``chunk_cat``), each freed right after; holes and
        parameters without a gradient are zero-filled.
        """
        self.finish()  # one reduction in flight per buffer set
        b = self.buffers
        layout, W = b.layout, b.world_size
        assert layout is not None
        rs_in = torch.empty(b.gathered.numel(), dtype=self.reduce_dtype, device=b.device)  # [W*S]
        for lo, hi in b.holes:
            rs_in[lo:hi].zero_()
        # A parameter without a gradient here is taken to have none on any rank (as FSDP2 assumes):
        # it still takes part in the reduce-scatter (as zeros) but keeps ``.grad = None``, so the
        # optimizer skips it as it would on one process.
        has_grad = set()
        for sp in b.params:
            dst = rs_in[sp.gathered_offset : sp.gathered_offset + sp.stored_numel]
            grad, acc = sp.unsharded.grad, sp.accumulated
            if acc is not None:  # micro-batches accumulated without sync, in the reduce dtype
                if grad is not None:
                    acc += grad
                grad, sp.accumulated = acc, None
            if grad is None:
                dst.zero_()
            else:
                if sp.order is not None:  # stored in another order: the copy permutes (zeros in its padding)
                    sp.order.take_into(dst, grad.reshape(-1), 0)
                else:
                    dst.copy_(grad.reshape(-1))
                sp.unsharded.grad = None
                has_grad.add(sp.index)
        # Straight into a new gradient buffer unless a sharded grad must be accumulated into (the
        # user kept .grad across steps), the reduce dtype differs from the parameters' or the
        # local gradient lives elsewhere (offload). Never into a buffer still alive without our
        # pieces: the user may hold an old .grad.
        accumulate = any(sp.sharded.grad is not None for sp in b.params)
        direct = not accumulate and self.reduce_dtype == b.orig_dtype and not b.offload
        S = b.local.numel()
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
                        summed=b.controls.divide_factor is not None,
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
        factor = b.controls.divide_factor
        if factor is not None:
            out.div_(factor)
        for sp in b.params:
            if not sp.sharded.requires_grad or sp.index not in has_grad:
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
        op = dist.ReduceOp.SUM if b.controls.divide_factor is not None else dist.ReduceOp.AVG
        b.agree(f"the all-reduce of group {b.described}", out.numel(), out.dtype, pg)
        b.count(2)
        assert b.layout is not None
        planned = b.layout.segment_numel * self.reduce_dtype.itemsize
        b.sent(2, out.numel() * out.element_size(), planned, out.dtype)  # [Note: traffic]
        wait(dist.all_reduce(out, op=op, group=pg, async_op=True), f"the all-reduce of group {b.described}", pg)
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
