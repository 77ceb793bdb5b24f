"""``ParamBuffers``: the persistent buffers of a group's parameters of one dtype and the work on them.

[Note: buffers]
Per buffer set of parameters (a group has one per dtype, [Note: buffer sets] in _buffer_set.py),
on every rank (``S = sum of bucket segments``, ``W`` ranks):
  * ``local``  [S], original dtype: the persistent shard. Sharded parameters are views into it
    with their block shapes, so the optimizer updates it in place. Never reallocated.
  * ``send``   [S], param dtype: only under mixed precision (the cast of ``local`` that is sent)
    or CPU offload (the copy on the device); else ``local`` itself.
  * ``gathered`` [W * S], param dtype: bucket ``b`` is ``[W * off_b, W * (off_b + S_b))``.
    Unsharded parameters are views into it; its storage is resized to 0 on reshard and back
    before the next all-gather, so the views (and autograd's saved references) stay valid.
  * the local gradient [S], original dtype: sharded ``.grad`` are views of it. The reduce-scatter
    allocates it and the buffer set keeps only a weak reference (``grad_buffer()``), so it lives exactly
    as long as a piece's ``.grad`` does: ``optimizer.zero_grad()`` (``set_to_none=True``, the
    default) frees it, and between steps gradients take no memory, as under FSDP2. Kept gradients
    (``set_to_none=False``, accumulation across steps) keep it, and the next reduce-scatter adds
    into them.
  * the reduce-scatter input [W * S], reduce dtype: allocated when the group's gradients are all
    in, filled from the unsharded ``.grad`` (autograd's own tensors, accumulated across
    micro-batches without sync) and freed when the reduce-scatter is waited for, at the next
    group's post-backward or the end of backward ([Note: async reduce-scatter] in _grad_sync.py);
    on gloo as soon as it is issued (gloo's work owns a copy: [Note: gloo's copies]).
Holes are padding: zeros that never reach a parameter.

[Note: CPU offload]
``offload_policy=CPUOffloadPolicy()``: ``local`` and the local gradient live on the host (pinned
when the device is CUDA); ``send`` [S] is then always a device buffer of its own, filled from
``local`` before each all-gather (cast included), and the reduce-scatter lands in a device
buffer [S] that ``finish_reduce`` copies into the host gradient. The optimizer steps the host
pieces, so its state is on the host. On a CPU-only machine the device is the CPU: the same copies
run, exactly (tests/runtime/test_fast_offload.py: bitwise equal to no offload). Parameters on a
GPU are refused for now: the collectives outside the step (state dicts, export, owner shifts) read
``local`` directly and are not staged through the device for NCCL, and no GPU has run it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from blockshard._errors import ShardingError
from blockshard.planner import GroupLayout
from blockshard.planner._units import block_shape
from blockshard.runtime.core._buffer_set import BufferSet, GroupControls
from blockshard.runtime.core._collectives import all_gather_into, holds_copies, shift_ranks
from blockshard.runtime.core._common import DeviceStreams, ShardedState, expect, in_backward
from blockshard.runtime.core._grad_sync import GradientSync
from blockshard.runtime.core._param import ShardedParam, tag_managed
from blockshard.runtime.core._post_forward import PostForwardGroup, keep_run, run_slices

if TYPE_CHECKING:
    from blockshard.runtime.core._owners import OwnerComputed

__all__ = ["ParamBuffers"]


class ParamBuffers(BufferSet):
    """The buffers and collectives of a group's parameters of one dtype ([Note: buffers]); its
    gradients are reduced by ``grads`` (a :class:`GradientSync`) where ``trainable``."""

    # an int reshard_after_forward: this rank's k-group, set by fully_shard, and the run kept
    # between forward and backward ([Note: reshard to a smaller world] in _post_forward.py)
    post_forward: PostForwardGroup | None = None
    _run: torch.Tensor | None = None

    def __init__(
        self,
        name: str,
        params: Sequence[ShardedParam],
        originals: Sequence[nn.Parameter],
        layout: GroupLayout | None,
        process_group: dist.ProcessGroup,
        *,
        costs: dict[str, float],
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        controls: GroupControls,
        trainable: bool = True,
        replicate_group: dist.ProcessGroup | None = None,
        offload: bool = False,
    ) -> None:
        super().__init__(name, process_group)
        self.params = list(params)
        self.costs = costs  # optimizer cost per tensor name, for rotation ([Note: rotation])
        # whether its parameters may train: the primary buffer set's may; another dtype's are frozen
        # and never reduced ([Note: mixed dtypes] in _dtypes.py)
        self.trainable = trainable
        self.controls = controls
        self.offload = offload  # CPUOffloadPolicy: local shard and gradient on the host ([Note: CPU offload])
        self._version_guard: torch.autograd._unsafe_preserve_version_counter | None = None
        self.owner_computed: OwnerComputed | None = None  # [Note: engine owner plan], set by fully_shard
        self.grads: GradientSync | None = None  # None: nothing to reduce (no layout)
        # mp_policy's dtypes as given (None: follow the parameters' dtype, which model.to(dtype) changes)
        self.policy_dtypes = (param_dtype, reduce_dtype)
        self._layout = layout
        if layout is None:  # a module without parameters of its own: nothing to gather
            if self.params:
                raise AssertionError(f"group {name!r} has parameters but no layout")
            return
        first = originals[0]
        self.orig_dtype = first.dtype
        self.param_dtype = param_dtype or self.orig_dtype
        self._alloc_buffers(first.device, layout.segment_numel, zeros=True)
        self.grads = GradientSync(self, reduce_dtype or self.param_dtype, replicate_group)
        self._place(layout)
        with torch.no_grad():
            for sp, orig in zip(self.params, originals, strict=True):
                flat = orig.detach().reshape(-1)
                mine = self.local[sp.local_offset : sp.local_offset + sp.local_numel]
                if sp.order is not None:  # stored in another order (a master in packed tile order)
                    sp.order.take_into(mine, flat, sp.units()[0])
                else:
                    mine.copy_(flat[sp.local_start : sp.local_start + sp.local_numel])
        self._make_views()
        self._free_gathered()

    @property
    def layout(self) -> GroupLayout | None:
        return self._layout

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        """HSDP's replicate group ([Note: HSDP]): the ranks holding the same pieces, over which
        gradients are all-reduced; None without HSDP (or with nothing to reduce: no layout)."""
        return self.grads.replicate_group if self.grads is not None else None

    # -- construction -----------------------------------------------------------------------------
    def _place(self, layout: GroupLayout) -> None:
        """Record where each parameter's piece and full view sit under ``layout``."""
        self._layout = layout
        self.holes = _holes(layout)  # gathered ranges no tensor covers
        pieces = {p.index: p for p in layout.pieces(self.rank)}
        index = {t.name: i for i, t in enumerate(layout.tensors)}  # a rotation reorders tensors
        for sp in self.params:
            sp.index = index[sp.fqn]
            sp.gathered_offset = layout.gathered_offset(sp.index)
            piece = pieces.get(sp.index)
            if piece is None:
                sp.local_start, sp.local_numel, sp.local_offset = 0, 0, 0
            else:
                sp.local_start, sp.local_numel, sp.local_offset = piece.start, piece.numel, piece.local_offset

    def tag_views(self) -> None:
        """Tag the parameter objects this buffer set made ([Note: optimizer guard], clipping)."""
        for sp in self.params:
            tag_managed(sp.sharded, self.name, process_group=self.process_group, group=weakref.ref(self))
            sp.sharded.global_shape = torch.Size(sp.shape)  # type: ignore[attr-defined]  # blockshard.global_shape
            tag_managed(sp.unsharded, self.name)

    @torch.no_grad()
    def materialize(self, device: torch.device) -> None:
        """A buffer set sharded on the meta device gets real, uninitialized buffers on ``device`` (as
        ``model.to_empty(device=...)`` asks) and new parameter objects over them; the meta ones
        are tagged as replaced, so an optimizer built over them raises. See [Note: meta init]."""
        expect(f"materialize group {self.name!r}", self.sharded_state, ShardedState.SHARDED)
        if self.offload and device.type != "cpu":
            raise ShardingError(
                f"group {self.name!r} has offload_policy=CPUOffloadPolicy(): materializing it on {device} is not "
                "enabled yet (see fully_shard's error for parameters off the CPU). Fix: model.to_empty(device='cpu'), "
                "or drop offload_policy"
            )
        S = self.local.numel()
        for sp in self.params:
            tag_managed(sp.sharded, self.name, original=True)
        self._alloc_buffers(device, S, zeros=False)
        if self.grads is not None:
            self.grads.forget_grad_buffer()
        for sp in self.params:
            sp.requires_grad = sp.sharded.requires_grad
        self._make_views()
        self._free_gathered()
        self.tag_views()

    def check_convertible(self, dtype: torch.dtype) -> None:
        """Raise if this buffer set cannot be converted to ``dtype`` now (a kind that never can says
        why): called for every group before any is converted."""
        held = [sp.fqn for sp in self.params if sp.sharded.grad is not None or sp.unsharded.grad is not None]
        held += [sp.fqn for sp in self.params if sp.accumulated is not None]
        if held or (self.grads is not None and (self.grads.reducing or self.grad_buffer() is not None)):
            raise ShardingError(
                f"converting group {self.name!r} to {dtype} (model.to(...), .half(), .double()) while its "
                f"parameters hold gradients ({held[:3] or 'a reduction in flight'}): they would keep the old "
                "dtype. Fix: call optimizer.zero_grad() (set_to_none=True) or model.zero_grad() first, or "
                "convert before training"
            )

    @torch.no_grad()
    def convert(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``model.to(dtype)``, ``.half()``, ``.double()`` after ``fully_shard`` ([Note: converting a
        sharded model] in _module.py): the local buffer converted by ``fn``, the other buffers made
        anew in the new dtype, new parameter objects over them; the old pieces are tagged replaced,
        so an optimizer built over them raises at its first step. :meth:`check_convertible` first."""
        expect(f"converting group {self.name!r}", self.sharded_state, ShardedState.SHARDED)
        converted = fn(self.local)
        dtype, S = converted.dtype, self.local.numel()
        for sp in self.params:
            sp.requires_grad = sp.sharded.requires_grad
            tag_managed(sp.sharded, self.name, original=True, replaced_by=f"converting the model to {dtype} replaced")
        self.orig_dtype = dtype
        self.param_dtype = self.policy_dtypes[0] or dtype
        self._alloc_buffers(self.device, S, zeros=False)
        self.local.copy_(converted)
        if self.grads is not None:
            self.grads.reduce_dtype = self.policy_dtypes[1] or self.param_dtype
            self.grads.forget_grad_buffer()
        self._make_views()
        self._free_gathered()
        self.tag_views()

    def _alloc_buffers(self, device: torch.device, S: int, *, zeros: bool) -> None:
        """``local`` [S] (on the host under offload, pinned when the device is CUDA), ``send`` [S]
        and ``gathered`` [W * S] on ``device``. [Note: CPU offload]"""
        self.device, W = device, self.world_size
        self.host = torch.device("cpu") if self.offload and device.type != "meta" else device
        self.streams = DeviceStreams(device, pinned=self.offload)
        pin = self.streams.pinned
        alloc = torch.zeros if zeros else torch.empty
        self.local = alloc(S, dtype=self.orig_dtype, device=self.host, pin_memory=pin)  # [S]
        separate = self.param_dtype != self.orig_dtype or self.offload
        self.send = torch.empty(S, dtype=self.param_dtype, device=device) if separate else self.local
        self.gathered = torch.empty(W * S, dtype=self.param_dtype, device=device)  # [W*S]

    def _make_views(self) -> None:
        """New parameter objects over the buffers: sharded (block-shaped) and unsharded (full)."""
        for sp in self.params:
            view = self.local[sp.local_offset : sp.local_offset + sp.local_numel]
            shape = (sp.local_numel,) if sp.order is not None else block_shape(sp.shape, sp.local_start, sp.local_numel)
            sp.sharded = nn.Parameter(view.view(shape), sp.requires_grad)
            full = self.gathered[sp.gathered_offset : sp.gathered_offset + sp.numel].view(sp.shape)
            # a TP parameter: the DTensor over its gathered local tensor ([Note: tensor-parallel parameters])
            sp.unsharded = nn.Parameter(full if sp.tp is None else sp.tp.wrap(full), sp.requires_grad)
            sp.set_module_params(sp.sharded)

    @torch.no_grad()
    def relayout(self, layout: GroupLayout, k: int) -> None:
        """Move to ``layout``: this buffer set's layout rotated by ``k`` segments (rank ``r``'s content
        moves to rank ``(r + k) % W``, see [Note: rotation]), one shift of ``local`` across ranks,
        then new parameter objects. ``k = 0`` with another layout: the caller moved ``local``
        already (``apply_shifts`` in _owners.py, [Note: shifts]); only the parameter objects are
        made anew. Only before training (no gradients, no optimizer state)."""
        expect(f"relayout of group {self.name!r}", self.sharded_state, ShardedState.SHARDED)
        if k % self.world_size and self.local.device.type != "meta":  # meta: no values to move
            staged = self.local.to(self.device)  # offload: the collective runs on the device
            self.local.copy_(shift_ranks(staged, k, self.process_group))
        for sp in self.params:
            sp.requires_grad = sp.sharded.requires_grad  # frozen since fully_shard, maybe
            # the old pieces are replaced: an optimizer built over them raises (_optim_guard.py)
            tag_managed(sp.sharded, self.name, original=True)
        self._place(layout)
        self._alloc_gathered()  # views need the storage's size (its contents are not touched)
        self._make_views()
        self._free_gathered()

    # -- all-gather -------------------------------------------------------------------------------
    def unshard(self, *, async_op: bool = False) -> None:
        """Issue the all-gathers that fill ``gathered`` (SHARDED -> UNSHARDING), and wait for them
        unless ``async_op`` (-> UNSHARDED). Nothing to do if already UNSHARDING or UNSHARDED."""
        if self.sharded_state is not ShardedState.SHARDED:
            if not async_op:
                self.wait_unshard()
            return
        if self._layout is None:
            self.sharded_state = ShardedState.UNSHARDED
            return
        if self._run is not None:  # [Note: reshard to a smaller world]
            if in_backward():
                self._unshard_from_run(async_op)
                return
            self._run = None  # outside backward the shards may have changed: gather them
        layout, W = self._layout, self.world_size
        self.agree(f"the all-gather of group {self.described}", self.local.numel(), self.send.dtype)
        self._start_gather()
        with self.streams.on("all_gather"):  # [Note: streams]
            if self.send is not self.local:  # mixed precision: the one cast of the step; offload: to the device
                self.send.copy_(self.local, non_blocking=self.streams.pinned)
            moved = 0
            for b, S_b in enumerate(layout.buckets):
                off = layout.bucket_local_offset(b)
                gathered, local = self.gathered[W * off : W * (off + S_b)], self.send[off : off + S_b]
                self._pending.append(all_gather_into(gathered, local, self.process_group, async_op=True))
                moved += gathered.numel() * gathered.element_size()
        self.sent(0, moved, layout.padded_numel * self.param_dtype.itemsize, self.send.dtype)  # [Note: traffic]
        self._issued(async_op)

    def _unshard_from_run(self, async_op: bool) -> None:
        """Backward's all-gather after a forward that kept a run: one all-gather per bucket over
        the ``k``-group refills the gathered bucket in place ([Note: reshard to a smaller world])."""
        pf, run, layout = self.post_forward, self._run, self._layout
        assert pf is not None and run is not None and layout is not None
        what = f"{self.gather_what} over its post-forward group of {pf.size} ranks"
        self.agree(what, run.numel(), run.dtype)  # on the shard group: every rank issues its k-group's now
        self._start_gather()
        with self.streams.on("all_gather"):  # [Note: streams]
            moved = 0
            for full, part in run_slices(layout, pf):
                gathered = self.gathered[full]
                self._pending.append(all_gather_into(gathered, run[part], pf.group, async_op=True))
                moved += gathered.numel() * gathered.element_size()
        self.sent(0, moved, layout.padded_numel * self.param_dtype.itemsize, run.dtype, ranks=pf.size)
        self._issued(async_op)

    def reshard_after_forward(self) -> None:
        """Post-forward under an int ``reshard_after_forward``: keep this member's run of the
        gathered buffer, then reshard ([Note: reshard to a smaller world]); without a ``k``-group
        (or nothing gathered), a plain :meth:`reshard`."""
        if self.sharded_state is ShardedState.UNSHARDING:  # a prefetch nobody used
            self.wait_unshard()
        pf, layout = self.post_forward, self._layout
        if pf is None or layout is None or self.sharded_state is not ShardedState.UNSHARDED:
            self.reshard()
            return
        run = keep_run(self.gathered, layout, pf)
        self.reshard()
        self._run = run

    def _start_gather(self) -> None:
        """Allocate the gathered buffer for an all-gather about to be issued."""
        self._alloc_gathered()
        # Refilling the buffer with the same values must not look like an in-place change to the
        # tensors autograd saved in forward (they are views of it). The all-gathers bump the
        # version counter when they finish, so the counter seen here is put back in wait_unshard.
        self._version_guard = torch.autograd._unsafe_preserve_version_counter(self.gathered)

    def _issued(self, async_op: bool) -> None:
        """The all-gathers are issued: count them, and wait for them unless ``async_op``."""
        self.sharded_state = ShardedState.UNSHARDING
        self.count(0)
        if not async_op:
            self.wait_unshard()

    @property
    def gather_what(self) -> str:
        return f"the all-gather of group {self.described}"

    def _finish_unshard(self) -> None:
        if self._layout is not None:
            self.streams.current_waits("all_gather")
        self._run = None  # gathered from, if kept ([Note: reshard to a smaller world])
        if self._version_guard is not None:
            self._version_guard.__exit__(None, None, None)  # the version before the all-gathers
            self._version_guard = None
        for sp in self.params:
            if sp.unsharded.requires_grad != sp.sharded.requires_grad:
                sp.unsharded.requires_grad_(sp.sharded.requires_grad)  # frozen or unfrozen since
            sp.set_module_params(sp.unsharded)

    def reshard(self) -> None:
        """Free the gathered storage and give the module its local pieces back (-> SHARDED)."""
        self._run = None  # a run kept after forward goes too ([Note: reshard to a smaller world])
        if self.sharded_state is ShardedState.UNSHARDING:  # a prefetch nobody used
            self.wait_unshard()
        if self.sharded_state is ShardedState.SHARDED:
            return
        for sp in self.params:
            sp.set_module_params(sp.sharded)
        if self._layout is not None:
            self._free_gathered()
        self.sharded_state = ShardedState.SHARDED

    @property
    def gathers_on_copies(self) -> bool:
        return self._layout is not None and holds_copies(self.process_group, self.device)

    def check_forward(self) -> None:
        self.check_registered()
        self.check_materialized()  # FSDP2: "should be materialized from meta device before training"

    def check_registered(self) -> None:
        """Raise if a module's parameter is no longer this buffer set's (replaced after ``fully_shard``)."""
        for sp in self.params:
            mine = sp.unsharded if self.sharded_state is ShardedState.UNSHARDED else sp.sharded
            for ref in sp.refs:
                current = ref.module._parameters.get(ref.attr)
                if current is not mine:
                    raise ShardingError(
                        f"parameter {sp.fqn!r} of group {self.name!r} was replaced after fully_shard (now "
                        f"{_describe(current)}); the engine would go on training its own piece and ignore the "
                        "new tensor. Fix: assign or load parameters before fully_shard, or copy values into "
                        "the sharded parameter in place (with torch.no_grad(): p.copy_(...)), or load them "
                        "with blockshard.load_full_state_dict"
                    )

    def check_materialized(self) -> None:
        """Raise if the buffer set is still on the meta device at a forward (FSDP2 checks at lazy init)."""
        if self._layout is not None and self.device.type == "meta":
            names = [sp.fqn if not self.path else f"{self.path}.{sp.fqn}" for sp in self.params]
            raise ShardingError(
                f"group {self.name!r} runs forward with its parameters still on the meta device ({names[:4]}"
                f"{' ...' if len(names) > 4 else ''}): they have no values. Fix: materialize the model before "
                "training: model.to_empty(device=...) then initialize (blockshard.init_parameters(model), or "
                "module.reset_parameters()), or load values with model.load_state_dict(sd, assign=True)"
            )

    # -- gradients ([Note: async reduce-scatter] in _grad_sync.py) ---------------------------------
    @property
    def trains(self) -> bool:
        """The primary buffer set reduces at every backward that syncs gradients (zeros for frozen
        parameters: every rank issues the same collectives); another dtype's never."""
        return self.trainable and self.grads is not None

    def grad_buffer(self) -> torch.Tensor | None:
        """The local gradient [S] while some sharded ``.grad`` views it, else None ([Note: buffers])."""
        return None if self.grads is None else self.grads.grad_buffer()

    def prepare_grads(self) -> None:
        if self.grads is not None:
            self.grads.prepare()

    def accumulate_grads(self) -> None:
        if self.grads is not None:
            self.grads.accumulate()

    def reduce_grads(self) -> None:
        if self.grads is not None:
            self.grads.reduce()

    def reached_without_grads(self) -> bool:
        return self.grads is not None and self.grads.reached_without_grads()

    @property
    def reducing(self) -> bool:
        return self.grads is not None and self.grads.reducing

    def finish_reduce(self) -> None:
        if self.grads is not None:
            self.grads.finish()

    def reset_step(self) -> None:
        """The unsharded gradients and the micro-batches accumulated, HSDP's outputs not all-reduced
        yet and a reduce-scatter in flight are lost with the step."""
        for sp in self.params:
            sp.unsharded.grad, sp.accumulated = None, None
        if self.grads is not None:
            self.grads.reset_step()

    def _alloc_gathered(self) -> None:
        storage = self.gathered.untyped_storage()
        nbytes = self.gathered.numel() * self.gathered.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)  # the all-gather writes every element, holes included

    def _free_gathered(self) -> None:
        self.gathered.untyped_storage().resize_(0)


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


def _describe(param: object) -> str:
    if isinstance(param, torch.Tensor):
        return f"a {type(param).__name__} of shape {tuple(param.shape)}"
    return repr(param)
