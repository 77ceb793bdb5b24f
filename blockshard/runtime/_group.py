"""``ParamGroup``: the persistent buffers of one ``fully_shard`` call and the work on them.

[Note: buffers]
Per group, on every rank (``S = sum of bucket segments``, ``W`` ranks):
  * ``local``  [S], original dtype: the persistent shard. Sharded parameters are views into it
    with their block shapes, so the optimizer updates it in place. Never reallocated.
  * ``send``   [S], param dtype: only under mixed precision, the cast of ``local`` that is sent.
  * ``gathered`` [W * S], param dtype: bucket ``b`` is ``[W * off_b, W * (off_b + S_b))``.
    Unsharded parameters are views into it; its storage is resized to 0 on reshard and back
    before the next all-gather, so the views (and autograd's saved references) stay valid.
  * ``grad``   [S], original dtype: the persistent local gradient; sharded ``.grad`` views it.
  * the reduce-scatter input [W * S], reduce dtype: allocated when the group's gradients are all
    in, filled from the unsharded ``.grad`` (autograd's own tensors, accumulated across
    micro-batches without sync) and freed after the reduce-scatter.
Holes are padding: zeros that never reach a parameter.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from blockshard.planner import GroupLayout
from blockshard.runtime._collectives import all_gather_into, reduce_scatter_avg
from blockshard.runtime._param import ShardedParam, block_shape

__all__ = ["GroupState", "ParamGroup"]


class GroupState(enum.Enum):
    SHARDED = "sharded"  # module holds sharded params; gathered storage freed
    UNSHARDED = "unsharded"  # module holds unsharded params (views of a filled gathered buffer)


class ParamGroup:
    def __init__(
        self,
        name: str,
        params: Sequence[ShardedParam],
        originals: Sequence[nn.Parameter],
        layout: GroupLayout | None,
        pg: dist.ProcessGroup,
        *,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
    ) -> None:
        self.name, self.params, self.layout, self.pg = name, list(params), layout, pg
        self.rank, self.world_size = pg.rank(), pg.size()
        self.requires_gradient_sync = True
        self.backward_pending = False
        self.num_grads_ready = 0
        self._pending: list = []  # async all-gather works of a prefetch
        self._version = 0  # version counter of ``gathered`` before the pending all-gathers
        self.state = GroupState.SHARDED
        if layout is None:  # a module without parameters of its own: nothing to gather
            assert not self.params
            return
        first = originals[0]
        self.device, self.orig_dtype = first.device, first.dtype
        self.param_dtype = param_dtype or self.orig_dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        S, W = layout.segment_numel, self.world_size
        self.local = torch.zeros(S, dtype=self.orig_dtype, device=self.device)  # [S]
        self.grad = torch.zeros(S, dtype=self.orig_dtype, device=self.device)  # [S]
        self.send = (
            self.local
            if self.param_dtype == self.orig_dtype
            else torch.empty(S, dtype=self.param_dtype, device=self.device)
        )
        self.gathered = torch.empty(W * S, dtype=self.param_dtype, device=self.device)  # [W*S]
        self._holes = _holes(layout)  # gathered ranges no tensor covers
        self._init_views(originals)
        self._free_gathered()

    # -- construction -----------------------------------------------------------------------------
    def _init_views(self, originals: Sequence[nn.Parameter]) -> None:
        pieces = {p.index: p for p in self.layout.pieces(self.rank)}
        for sp, orig in zip(self.params, originals, strict=True):
            piece = pieces.get(sp.index)
            sp.gathered_offset = self.layout.gathered_offset(sp.index)
            if piece is not None:
                sp.local_start, sp.local_numel, sp.local_offset = piece.start, piece.numel, piece.local_offset
            with torch.no_grad():
                flat = orig.detach().reshape(-1)
                self.local[sp.local_offset : sp.local_offset + sp.local_numel].copy_(
                    flat[sp.local_start : sp.local_start + sp.local_numel]
                )
            view = self.local[sp.local_offset : sp.local_offset + sp.local_numel]
            sp.sharded = nn.Parameter(
                view.view(block_shape(sp.shape, sp.local_start, sp.local_numel)), sp.requires_grad
            )
            full = self.gathered[sp.gathered_offset : sp.gathered_offset + sp.numel].view(sp.shape)
            sp.unsharded = nn.Parameter(full, sp.requires_grad)
            sp.set_module_params(sp.sharded)

    # -- all-gather -------------------------------------------------------------------------------
    def unshard(self, *, async_op: bool = False) -> None:
        """Start (or do) the all-gathers that fill ``gathered``; :meth:`wait_unshard` finishes."""
        if self.state is GroupState.UNSHARDED or self._pending:
            return
        if self.layout is None:
            self.state = GroupState.UNSHARDED
            return
        self._alloc_gathered()
        if self.send is not self.local:
            self.send.copy_(self.local)  # mixed precision: the one cast of the step
        W = self.world_size
        # Refilling the buffer with the same values must not look like an in-place change to the
        # tensors autograd saved in forward (they are views of it): the version counter is put
        # back once the all-gathers have finished (see wait_unshard).
        self._version = self.gathered._version
        for b, S_b in enumerate(self.layout.buckets):
            off = self.layout.bucket_local_offset(b)
            gathered, local = self.gathered[W * off : W * (off + S_b)], self.send[off : off + S_b]
            self._pending.append(all_gather_into(gathered, local, self.pg, async_op=True))
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if self.state is GroupState.UNSHARDED:
            return
        if not self._pending:
            self.unshard()
            return
        for work in self._pending:
            work.wait()
        torch._C._autograd._unsafe_set_version_counter((self.gathered,), (self._version,))
        self._pending.clear()
        for sp in self.params:
            sp.set_module_params(sp.unsharded)
        self.state = GroupState.UNSHARDED

    def reshard(self) -> None:
        if self._pending:  # a prefetch nobody used: finish it before freeing its buffer
            self.wait_unshard()
        if self.state is GroupState.SHARDED:
            return
        for sp in self.params:
            sp.set_module_params(sp.sharded)
        if self.layout is not None:
            self._free_gathered()
        self.state = GroupState.SHARDED

    def _alloc_gathered(self) -> None:
        storage = self.gathered.untyped_storage()
        nbytes = self.gathered.numel() * self.gathered.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)  # the all-gather writes every element, holes included

    def _free_gathered(self) -> None:
        self.gathered.untyped_storage().resize_(0)

    # -- gradients --------------------------------------------------------------------------------
    def prepare_grads(self) -> None:
        """Before this group's backward: start counting its gradients."""
        self.backward_pending = True
        self.num_grads_ready = 0

    @property
    def num_grads_expected(self) -> int:
        return sum(sp.requires_grad for sp in self.params)

    def reduce_grads(self) -> None:
        """Reduce-scatter (average) the unsharded gradients into ``grad``; set sharded ``.grad``.

        Gradients are packed into the reduce-scatter input in the gathered layout (one copy, cast
        to the reduce dtype, as FSDP2's ``chunk_cat``), each freed right after; holes and
        parameters without a gradient are zero-filled.
        """
        W = self.world_size
        if self.layout is None:
            return
        rs_in = torch.empty(self.gathered.numel(), dtype=self.reduce_dtype, device=self.device)  # [W*S]
        for lo, hi in self._holes:
            rs_in[lo:hi].zero_()
        # A parameter without a gradient here is taken to have none on any rank (as FSDP2 assumes):
        # it still takes part in the reduce-scatter (as zeros) but keeps ``.grad = None``, so the
        # optimizer skips it as it would on one process.
        has_grad = set()
        for sp in self.params:
            dst = rs_in[sp.gathered_offset : sp.gathered_offset + sp.numel]
            if sp.unsharded.grad is None:
                dst.zero_()
            else:
                dst.copy_(sp.unsharded.grad.reshape(-1))
                sp.unsharded.grad = None
                has_grad.add(sp.index)
        # Straight into the persistent grad buffer unless a sharded grad must be accumulated into
        # (the user kept .grad across steps) or the reduce dtype differs from the parameters'.
        accumulate = any(sp.sharded.grad is not None for sp in self.params)
        direct = not accumulate and self.reduce_dtype == self.orig_dtype
        out = self.grad if direct else torch.empty(self.grad.numel(), dtype=self.reduce_dtype, device=self.device)
        for b, S_b in enumerate(self.layout.buckets):
            off = self.layout.bucket_local_offset(b)
            reduce_scatter_avg(out[off : off + S_b], rs_in[W * off : W * (off + S_b)], self.pg)
        for sp in self.params:
            if not sp.requires_grad or sp.index not in has_grad:
                continue
            lo, hi = sp.local_offset, sp.local_offset + sp.local_numel
            if sp.sharded.grad is None:
                if not direct:
                    self.grad[lo:hi].copy_(out[lo:hi])
                sp.sharded.grad = self.grad[lo:hi].view(sp.sharded.shape)
            else:
                sp.sharded.grad += out[lo:hi].view(sp.sharded.shape).to(self.orig_dtype)

    def finish_backward(self) -> None:
        """After this group's backward: sync (unless accumulating without sync) and reshard."""
        if not self.backward_pending:
            return
        self.backward_pending = False
        self.reshard()  # free the gathered parameters before the reduce-scatter needs its output
        if self.requires_gradient_sync:
            self.reduce_grads()


def _holes(layout: GroupLayout) -> list[tuple[int, int]]:
    """Ranges of the gathered buffer that hold no tensor (padding between and after tensors)."""
    out, W = [], layout.world_size
    for b, S_b in enumerate(layout.buckets):
        base, end = layout.bucket_gathered_offset(b), layout.bucket_gathered_offset(b) + W * S_b
        pos = base
        for t in layout.tensors:
            if t.bucket == b:
                if base + t.offset > pos:
                    out.append((pos, base + t.offset))
                pos = base + t.end
        if pos < end:
            out.append((pos, end))
    return out
