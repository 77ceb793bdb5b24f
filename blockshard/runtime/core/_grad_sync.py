"""The gradient half of a ``ParamBuffers``: accumulation without sync, the asynchronous
reduce-scatter into the local gradient, and HSDP's all-reduce ([Note: buffers] in _buffers.py).

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
flight with the step's gradients.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from blockshard.runtime.core._collectives import holds_copies, reduce_scatter_avg, wait

if TYPE_CHECKING:
    from blockshard.planner import GroupLayout
    from blockshard.runtime.core._common import CollectiveTally, DeviceStreams
    from blockshard.runtime.core._param import ShardedParam

__all__ = ["GradientSync"]


class GradientSync:
    """The gradient methods of :class:`~blockshard.runtime.core._buffers.ParamBuffers` (its buffers and
    flags are set by ``ParamBuffers.__init__``)."""

    name: str
    params: list[ShardedParam]
    process_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None
    world_size: int
    local: torch.Tensor
    gathered: torch.Tensor
    device: torch.device
    host: torch.device
    streams: DeviceStreams
    offload: bool
    orig_dtype: torch.dtype
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    divide_factor: float | None
    requires_all_reduce: bool
    tally: CollectiveTally | None
    tally_index: int
    _layout: GroupLayout | None
    _holes: list[tuple[int, int]]
    _grad: weakref.ref[torch.Tensor] | None
    _partial: torch.Tensor | None
    _reduction: _Reduction | None

    @property
    def described(self) -> str:  # ParamBuffers's: its name and path, for messages
        raise NotImplementedError

    def grad_buffer(self) -> torch.Tensor | None:
        """The local gradient [S] while some sharded ``.grad`` views it, else None ([Note: buffers])."""
        return None if self._grad is None else self._grad()

    def _new_grad_buffer(self) -> torch.Tensor:
        # not zeroed: only the pieces the reduce-scatter wrote are ever viewed
        buf = torch.empty(self.local.numel(), dtype=self.orig_dtype, device=self.host, pin_memory=self.streams.pinned)
        self._grad = weakref.ref(buf)
        return buf

    def accumulate_grads(self) -> None:
        """Backward without gradient sync: keep the unsharded gradients for the next backward, in
        the reduce dtype when it differs from the parameters' (as FSDP2 does: bf16 micro-batch
        gradients summed in fp32)."""
        if self._layout is None or self.reduce_dtype == self.param_dtype:
            return  # autograd accumulates into the unsharded .grad by itself
        for sp in self.params:
            grad = sp.unsharded.grad
            if grad is None:
                continue
            if sp.accumulated is None:
                sp.accumulated = grad.to(self.reduce_dtype)
            else:
                sp.accumulated += grad
            sp.unsharded.grad = None

    def reduce_grads(self) -> None:
        """Pack the unsharded gradients and issue their reduce-scatter (average) into the local
        gradient, asynchronously: :meth:`finish_reduce` waits and sets the sharded ``.grad``
        ([Note: async reduce-scatter]).

        Gradients are packed into the reduce-scatter input in the gathered layout (one copy, cast
        to the reduce dtype, as FSDP2's ``chunk_cat``), each freed right after; holes and
        parameters without a gradient are zero-filled.
        """
        if self._layout is None:
            return
        self.finish_reduce()  # one reduction in flight per group
        layout, W = self._layout, self.world_size
        streams = self.streams
        rs_in = torch.empty(self.gathered.numel(), dtype=self.reduce_dtype, device=self.device)  # [W*S]
        for lo, hi in self._holes:
            rs_in[lo:hi].zero_()
        # A parameter without a gradient here is taken to have none on any rank (as FSDP2 assumes):
        # it still takes part in the reduce-scatter (as zeros) but keeps ``.grad = None``, so the
        # optimizer skips it as it would on one process.
        has_grad = set()
        for sp in self.params:
            dst = rs_in[sp.gathered_offset : sp.gathered_offset + sp.numel]
            grad, acc = sp.unsharded.grad, sp.accumulated
            if acc is not None:  # micro-batches accumulated without sync, in the reduce dtype
                if grad is not None:
                    acc += grad
                grad, sp.accumulated = acc, None
            if grad is None:
                dst.zero_()
            else:
                dst.copy_(grad.reshape(-1))
                sp.unsharded.grad = None
                has_grad.add(sp.index)
        # Straight into a new gradient buffer unless a sharded grad must be accumulated into (the
        # user kept .grad across steps), the reduce dtype differs from the parameters' or the
        # local gradient lives elsewhere (offload). Never into a buffer still alive without our
        # pieces: the user may hold an old .grad.
        accumulate = any(sp.sharded.grad is not None for sp in self.params)
        direct = not accumulate and self.reduce_dtype == self.orig_dtype and not self.offload
        S = self.local.numel()
        buf = self._new_grad_buffer() if direct else self.grad_buffer() if accumulate else None
        out = buf if direct else torch.empty(S, dtype=self.reduce_dtype, device=self.device)
        assert out is not None
        if self.tally is not None:
            self.tally.record(self.tally_index, 1)
        works = []
        with streams.on("reduce_scatter"):  # [Note: streams]
            for b, S_b in enumerate(layout.buckets):
                off = layout.bucket_local_offset(b)
                works.append(
                    reduce_scatter_avg(
                        out[off : off + S_b],
                        rs_in[W * off : W * (off + S_b)],
                        self.process_group,
                        async_op=True,
                        summed=self.divide_factor is not None,
                    )
                )
        # gloo reduce-scatters a copy of its input that the work owns: ours is not read again,
        # so it is freed now, not while the next group's backward runs ([Note: gloo's copies])
        keep = None if holds_copies(self.process_group, rs_in.device) else rs_in
        del rs_in
        self._reduction = _Reduction(works, keep, out, buf, direct, has_grad)

    @property
    def reducing(self) -> bool:
        """A reduce-scatter of this group is in flight (issued, not waited for)."""
        return self._reduction is not None

    def drop_reduce(self) -> None:
        """Forget a reduction in flight (``reset_iter_state`` after an aborted step): its
        gradients are lost with the step. The collective itself still completes in the background."""
        self._reduction = None

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter in flight (bounded, [Note: collective integrity]), free its
        input, all-reduce across replicas (HSDP) and point the sharded ``.grad`` at the result."""
        red, self._reduction = self._reduction, None
        if red is None:
            return
        for work in red.works:
            wait(work, f"the reduce-scatter of group {self.described}", self.process_group)
        self.streams.current_waits("reduce_scatter")
        out, buf, direct, has_grad = red.out, red.buf, red.direct, red.has_grad
        del red  # the works (gloo: with their copy of the input) and the input, if kept, are freed here
        if self.replicate_group is not None and not self._all_reduce(out):
            return  # set_requires_all_reduce(False): kept for the next all-reduce, no .grad yet
        if self.divide_factor is not None:
            out.div_(self.divide_factor)
        for sp in self.params:
            if not sp.sharded.requires_grad or sp.index not in has_grad:
                continue
            lo, hi = sp.local_offset, sp.local_offset + sp.local_numel
            if sp.sharded.grad is None:
                if not direct:
                    if buf is None:
                        buf = self._new_grad_buffer()
                    buf[lo:hi].copy_(out[lo:hi], non_blocking=self.streams.pinned)  # offload: to the host
                assert buf is not None
                sp.sharded.grad = buf[lo:hi].view(sp.sharded.shape)
            else:
                sp.sharded.grad += out[lo:hi].view(sp.sharded.shape).to(sp.sharded.grad.device, self.orig_dtype)
        self.streams.host_copies_done()

    def _all_reduce(self, out: torch.Tensor) -> bool:
        """[Note: HSDP] Average (sum, with a divide factor) ``out`` over the replicate axis, adding
        the outputs kept while ``requires_all_reduce`` was off; False while it is off."""
        if self._partial is not None:
            out += self._partial
        if not self.requires_all_reduce:
            self._partial = out  # no .grad views it: the next reduce-scatter adds it in
            return False
        self._partial = None
        pg = self.replicate_group
        assert pg is not None
        op = dist.ReduceOp.SUM if self.divide_factor is not None else dist.ReduceOp.AVG
        if self.tally is not None:
            self.tally.record(self.tally_index, 2)
        wait(dist.all_reduce(out, op=op, group=pg, async_op=True), f"the all-reduce of group {self.described}", pg)
        return True


@dataclass(eq=False)
class _Reduction:
    """A group's reduce-scatter in flight: its works, and its input kept alive until the wait
    (but on gloo, whose works own a copy of it: [Note: gloo's copies])."""

    works: list
    rs_in: torch.Tensor | None  # [W*S], reduce dtype; None where the backend copied it (gloo)
    out: torch.Tensor  # [S], reduce dtype: the local gradient itself when ``direct``
    buf: torch.Tensor | None  # the local gradient to point .grad at (None: allocated when needed)
    direct: bool
    has_grad: set[int]
