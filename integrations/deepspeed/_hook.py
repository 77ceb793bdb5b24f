"""The ZeRO-1/2 hook: a ``DeepSpeedZeroOptimizer`` subclass with a block-aligned flat layout.

What stock DeepSpeed 0.19.8 does (``deepspeed/runtime/zero/stage_1_and_2.py``): per optimizer
``param_group``, ``__init__`` flattens the parameters in order (``round_robin_bit16_groups``, with
``round_robin_bit16_padding[i][j]`` zeros after parameter ``j``, non-zero only with
``zero_optimization.parameter_alignment``) by ``flatten_dense_tensors_aligned``, pads the buffer to
a multiple of ``2 * W`` and gives rank ``r`` the slice ``[r*S, (r+1)*S)`` with
``S = len(flat) // W`` (``get_data_parallel_partitions``). The inner optimizer sees one flat fp32
tensor per ``param_group`` (``single_partition_of_fp32_groups[i]``). Everything downstream reads the layout
from those lists -- ``get_partition_info``, ``initialize_gradient_partition`` (where each gradient
lands: ``grad_partition_insertion_offset`` / ``grad_start_offset``), ``average_tensor``,
``get_flat_partition``'s padded path, ``get_grad_position``, ``_link_all_hp_params``, the
checkpoint's ``PARAM_ALIGNMENT_PADDINGS`` check -- except two values computed inline in
``__init__``: ``padded_group_numel`` (only used for ``groups_padding``, which this hook recomputes)
and the stock padding itself (replaced in place, see below).

The hook (:class:`BlockshardZeroOptimizer`):

1. **Layout.** ``flatten_dense_tensors_aligned`` is called once per ``param_group`` from ``__init__`` with the
   ``param_group``'s ``param_padding`` list (the same list object as ``round_robin_bit16_padding[i]``); the
   override computes :func:`blockshard.planner.ordered_layout` for the ``param_group`` (semantics rules resolved on
   the parameters' names and shapes) and writes the holes into that list and the starts into
   ``round_robin_bit16_offsets[i]`` *in place*, then builds the buffer of ``W * S`` elements. Every
   partition boundary then falls on an allowed cut (multiples of 256 and no piece below 4096 for
   ``bnb8bit``; never inside a matrix for ``matrix``).
2. **Per-parameter views.** After ``__init__`` the inner optimizer's ``param_groups[i]`` holds, instead of
   the one flat tensor, one view of that tensor per parameter piece in this rank's partition: a
   whole parameter with its shape (a matrix stays 2-D for Muon), a piece of a split parameter as
   1-D. ``_optimizer_step`` points each view's ``.grad`` at the matching slice of the flat
   gradient partition, and bitsandbytes ``GlobalOptimManager`` overrides of a parameter (the HF
   Trainer's 32-bit state for embeddings) follow it onto its views (``_bnb_overrides``). So an unmodified optimizer computes on each parameter what it computes on
   one process: bitsandbytes' 8-bit state starts its 256-blocks at each parameter's start and keeps
   fp32 state for parameters below 4096 elements exactly as on one process (over one flat tensor it
   would quantize every parameter, small ones included, in blocks straddling parameters), and Muon
   orthogonalizes whole matrices with momentum only on the rank that owns each matrix.
3. ``groups_padding`` is recomputed (checkpoints strip it); ``state_dict`` records the layout and
   ``load_state_dict`` refuses optimizer state or fp32 weights saved with another layout (another
   world size, semantics or parameter set) with a :class:`DeepSpeedHookError`.

ZeRO-3 is integrations/deepspeed/_stage3.py ([Note: ZeRO-3 owner-compute]).

Refused with a :class:`DeepSpeedHookError` (not silently wrong): optimizer offload, ZenFlow, MoE layers (expert ``param_groups``),
``elastic_checkpoint``, DeepSpeed's own ``MuonWithAuxAdam`` and ``Adagrad`` (both assume the
single flat tensor), Muon-like inner optimizers whose matrices would be split (use
``"semantics": "matrix"``), and engines whose ZeRO-1/2 optimizer is not DeepSpeedZeroOptimizer
(bf16 ZeRO-1 with fp32 gradient accumulation uses ``BF16_Optimizer``). Not supported with the
hook: universal checkpoints and ``deepspeed.utils.safe_get_full_optimizer_state`` (both assume
one flat state tensor per ``param_group``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from blockshard.planner import OrderedLayout, alignment_numel, ordered_layout
from blockshard.planner._units import layout_hash
from blockshard.runtime._report import PartitionGroup
from blockshard.semantics import TensorSpec, fused_parts

from ._bnb_overrides import follow_overrides, resolve_module_overrides
from ._config import DeepSpeedHookError
from ._pending import pending
from ._refusals import refuse_shared
from ._stage3 import make_stage3
from ._traffic import HookTraffic
from ._unused import UsedParameters

__all__ = ["LAYOUT_KEY", "BlockshardZeroOptimizer", "hooked_classes"]  # noqa: F822 (created lazily by __getattr__)

LAYOUT_KEY = "blockshard_layout"


@dataclass
class _View:
    param_index: int  # index in round_robin_bit16_groups[i]
    name: str
    tensor: torch.Tensor  # a view of the flat fp32 partition, with the parameter's shape when whole
    seg_offset: int
    numel: int
    whole: bool


@dataclass
class _GroupState:
    layout: OrderedLayout
    names: list[str]
    labels: list[str]
    unit_numels: list[int] = field(default_factory=list)
    views: list[_View] = field(default_factory=list)
    dtype: torch.dtype = torch.float32  # the flat buffer's (the 16-bit parameters')


_CLASSES: dict[str, type] = {}


def hooked_classes() -> dict[str, type]:
    """``{"zero12": BlockshardZeroOptimizer, "zero3": BlockshardStage3}`` (created on first use)."""
    if not _CLASSES:
        _CLASSES["zero12"] = _make_zero12()
        _CLASSES["zero3"] = make_stage3()
    return _CLASSES


def __getattr__(name: str) -> type:
    if name == "BlockshardZeroOptimizer":
        return hooked_classes()["zero12"]
    raise AttributeError(name)


def _refuse_unsupported(init_optimizer: torch.optim.Optimizer, kwargs: dict[str, Any]) -> None:
    refuse_shared(init_optimizer, kwargs, "blockshard's DeepSpeed hook", ("offload_optimizer_config",))
    if kwargs.get("has_moe_layers"):
        raise DeepSpeedHookError("MoE layers (expert param_groups) are not supported by blockshard's DeepSpeed hook")
    if kwargs.get("elastic_checkpoint"):
        raise DeepSpeedHookError(
            "zero_optimization.elastic_checkpoint merges one flat optimizer state per param_group across ranks; with "
            "the blockshard hook the state is per parameter piece: set elastic_checkpoint to false"
        )
    if isinstance(init_optimizer, torch.optim.Adagrad):
        raise DeepSpeedHookError(
            "inner optimizer Adagrad assumes DeepSpeed's single flat tensor per param_group; with blockshard use "
            'torch.optim.Muon (with "semantics": "matrix") or another torch/bitsandbytes optimizer'
        )


def _make_zero12() -> type:
    from deepspeed import comm as dist
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    class BlockshardZeroOptimizer(DeepSpeedZeroOptimizer):
        """DeepSpeedZeroOptimizer with a block-aligned layout and per-parameter views (module docstring)."""

        def __init__(self, init_optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            p = pending()
            if p is None:
                raise DeepSpeedHookError(
                    "BlockshardZeroOptimizer is created by blockshard.integrations.deepspeed."
                    "initialize(); do not construct it directly"
                )
            _refuse_unsupported(init_optimizer, kwargs)
            self._bs_config = p.config
            self._bs_module_types = p.module_types
            self._bs_groups: list[_GroupState] = []
            self._bs_building = True
            self._bs_overrides_resolved = False
            super().__init__(init_optimizer, *args, **kwargs)
            self._bs_building = False
            self._bs_finish()
            # [Note: unused parameters]: parameters no rank got a gradient for step with grad None
            self._bs_order = [(i, t) for i, g in enumerate(self.round_robin_bit16_groups) for t in range(len(g))]
            self._bs_found: Callable[[], set[int]] | None = None  # during a step: the unused parameters
            self._bs_used = (
                UsedParameters([p for g in self.round_robin_bit16_groups for p in g], self._grad_acc_hooks)
                if self._bs_config.unused_parameters == "exact"
                else None
            )
            # [Note: traffic]: which collective DeepSpeed reduces gradient buckets with (average_tensor)
            by_reduce = self.reduce_scatter and self.contiguous_gradients and not self.use_multi_rank_bucket_allreduce
            self._bs_traffic = HookTraffic(self.blockshard_engine(), reduce_kind_is_reduce=by_reduce)

        # -- layout ------------------------------------------------------------------------------
        def flatten_dense_tensors_aligned(
            self,
            tensor_list: list[torch.Tensor],
            alignment: int,
            use_cpu_data: bool = False,
            param_padding: list[int] | None = None,
        ) -> torch.Tensor:
            if not getattr(self, "_bs_building", False) or param_padding is None:
                stock: torch.Tensor = super().flatten_dense_tensors_aligned(
                    tensor_list, alignment, use_cpu_data, param_padding
                )
                return stock
            i = len(self.bit16_groups_flat)
            params = self.round_robin_bit16_groups[i]
            metas = self.round_robin_bit16_meta[i]
            assert len(params) == len(tensor_list) == len(param_padding), "unexpected DeepSpeed flatten call"
            w = dist.get_world_size(group=self.real_dp_process_group[i])
            dtype = metas[0].dtype
            itemsize = torch.tensor([], dtype=dtype).element_size()
            align = math.lcm(
                alignment_numel(self._bs_config.alignment_bytes, itemsize), self.nccl_start_alignment_factor
            )
            names, grids, labels = [], [], []
            for j, (param, meta) in enumerate(zip(params, metas, strict=True)):
                name = self.param_names.get(param) or f"param_group{i}.{j}"
                spec = TensorSpec(
                    name=name,
                    shape=tuple(meta.shape),
                    dtype=dtype,
                    module_type=self._bs_module_types.get(id(param)),
                    param_group=i,
                )
                res = self._bs_config.rules.resolve(spec)
                if fused_parts(res.label):
                    raise DeepSpeedHookError(
                        f"parameter {name!r} of shape {tuple(meta.shape)} is declared a fused weight "
                        f"({res.label!r}): Muon per part runs in blockshard.fully_shard with "
                        "blockshard.optim.Muon; the DeepSpeed hook steps each matrix whole. Fix: drop the 'parts' "
                        'rule from the "blockshard" section\'s semantics'
                    )
                names.append(name)
                grids.append(res.grid)
                labels.append(res.label)
            layout = ordered_layout(grids, w, align)
            assert layout.padded_numel % alignment == 0, (layout.padded_numel, alignment)
            param_padding[:] = layout.paddings
            self.round_robin_bit16_offsets[i][:] = list(layout.starts)
            src = [p.cpu_data for p in params] if use_cpu_data else list(tensor_list)
            pieces = []
            for t, pad in zip(src, param_padding, strict=True):
                pieces.append(t.contiguous().view(-1))
                if pad:
                    pieces.append(torch.zeros(pad, dtype=t.dtype, device=t.device))
            self._bs_groups.append(_GroupState(layout, names, labels, [g.unit_numel for g in grids], dtype=dtype))
            flat: torch.Tensor = self.flatten(pieces)
            return flat

        def _bs_finish(self) -> None:
            inner_name = type(self.optimizer).__name__.lower()
            for i, gs in enumerate(self._bs_groups):
                rank = dist.get_rank(group=self.real_dp_process_group[i])
                lay = gs.layout
                assert self.partition_size[i] == lay.segment_numel, (self.partition_size[i], lay.segment_numel)
                # padding at the end of this rank's partition (what checkpoints strip)
                last_end = max((s + n for s, n in zip(lay.starts, lay.numels, strict=True)), default=0)
                lo, hi = rank * lay.segment_numel, (rank + 1) * lay.segment_numel
                self.groups_padding[i] = hi - min(max(last_end, lo), hi)
                flat = self.single_partition_of_fp32_groups[i]
                base = flat.detach()
                gs.views = []
                for t, _t_off, seg_off, n in lay.pieces(rank):
                    shape = tuple(self.round_robin_bit16_meta[i][t].shape)
                    whole = n == lay.numels[t]
                    v = base.narrow(0, seg_off, n)
                    if whole:
                        v = v.view(shape)
                    elif len(shape) >= 2 and _needs_whole_matrices(self.optimizer, inner_name, i):
                        raise DeepSpeedHookError(
                            f"parameter {gs.names[t]!r} of shape {shape} is split across ZeRO partitions "
                            f"(semantics {gs.labels[t]!r}), but the inner optimizer {type(self.optimizer).__name__} "
                            'needs whole matrices: set "blockshard": {"semantics": "matrix"} (or a rule '
                            "giving that parameter 'matrix')"
                        )
                    gs.views.append(_View(t, gs.names[t], v, seg_off, n, whole))
                self.optimizer.param_groups[i]["params"] = [v.tensor for v in gs.views]

        def _bs_refresh_views(self, i: int) -> None:
            """Re-point the views if DeepSpeed replaced the fp32 partition's storage (keeps state keys)."""
            flat = self.single_partition_of_fp32_groups[i]
            gs = self._bs_groups[i]
            if gs.views and gs.views[0].tensor.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
                base = flat.detach()
                for v in gs.views:
                    nv = base.narrow(0, v.seg_offset, v.numel)
                    v.tensor.data = nv.view(v.tensor.shape)

        # -- step ---------------------------------------------------------------------------------
        def _optimizer_step(self, group_no: int) -> None:
            self._bs_refresh_views(group_no)
            grad = self.single_partition_of_fp32_groups[group_no].grad
            views = self._bs_groups[group_no].views
            params = self.round_robin_bit16_groups[group_no]
            if not self._bs_overrides_resolved:  # bitsandbytes' check_overrides, first step
                resolve_module_overrides(self.optimizer, [p for g in self.round_robin_bit16_groups for p in g])
                self._bs_overrides_resolved = True
            try:
                unused = {self._bs_order[k] for k in self._bs_found()} if self._bs_found else set()
                for v in views:
                    skip = grad is None or (group_no, v.param_index) in unused
                    v.tensor.grad = None if skip else grad.narrow(0, v.seg_offset, v.numel).view(v.tensor.shape)
                with follow_overrides(self.optimizer, params, [(v.tensor, v.param_index) for v in views]):
                    super()._optimizer_step(group_no)  # DeepSpeed's returns None
            finally:
                for v in views:
                    v.tensor.grad = None

        # -- counters (integrations/deepspeed/_traffic.py) -----------------------------------------
        def reduce_independent_p_g_buckets_and_remove_grads(self, param: torch.Tensor, i: int) -> None:
            if param.numel() and getattr(param, "ds_grad_is_ready", True):  # DeepSpeed's own conditions
                self._bs_traffic.handed(param, self.get_param_comm_dtype(param))
            with self._bs_traffic.tap("gradients"):
                super().reduce_independent_p_g_buckets_and_remove_grads(param, i)

        def independent_gradient_partition_epilogue(self) -> None:
            with self._bs_traffic.tap("gradients"):
                super().independent_gradient_partition_epilogue()
            self._bs_traffic.end_round()

        def step(self, closure: object = None) -> None:
            self._bs_traffic.plan_gathers(
                [
                    (
                        self.bit16_groups_flat[i],
                        gs.layout.padded_numel * gs.dtype.itemsize,
                        f"{self.blockshard_engine()} param_group {i}",
                    )
                    for i, gs in enumerate(self._bs_groups)
                ]
            )
            if self._bs_used is not None:  # waited for where the first view steps (overlapping the norms)
                self._bs_found = self._bs_used.unused_everywhere(self.dp_process_group, self.device)
            try:
                with self._bs_traffic.tap("gather"):
                    super().step(closure)  # DeepSpeed's returns None
            finally:
                if self._bs_used is not None and self._bs_found is not None:
                    self._bs_found()
                    self._bs_used.clear()
                self._bs_found = None
            self._bs_traffic.end_step()

        def update_lp_params(self) -> None:
            with self._bs_traffic.tap("gather"):
                super().update_lp_params()

        def _lazy_init_hp_params_optimizer_state(self) -> None:
            # DeepSpeed links optimizer state of the one flat tensor per param_group to the parameters
            # (safe_get_full_optimizer_state); with per-parameter views there is no such tensor.
            self._hp_optimizer_states_linked = True

        # -- checkpoints ----------------------------------------------------------------------------
        def blockshard_layout(self) -> list[dict[str, Any]]:
            """Per ``param_group``: the layout (JSON), parameter names and semantics labels."""
            return [{**gs.layout.to_json(), "names": gs.names, "semantics": gs.labels} for gs in self._bs_groups]

        # -- blockshard.report (a PartitionSource) -------------------------------------------------
        def blockshard_partitions(self) -> list[PartitionGroup]:
            return [
                PartitionGroup(
                    layout=gs.layout,
                    names=tuple(gs.names),
                    params=tuple(self.round_robin_bit16_groups[i]),
                    semantics=tuple(gs.labels),
                    unit_numels=tuple(gs.unit_numels),
                    shapes=tuple(tuple(m.shape) for m in self.round_robin_bit16_meta[i]),
                    partition=self.single_partition_of_fp32_groups[i],
                    process_group=self.real_dp_process_group[i],
                    views=[(v.param_index, v.tensor) for v in gs.views],
                )
                for i, gs in enumerate(self._bs_groups)
            ]

        def blockshard_engine(self) -> str:
            return f"DeepSpeed ZeRO-{2 if self.partition_gradients else 1}"

        def blockshard_inner_optimizer(self) -> torch.optim.Optimizer:
            inner: torch.optim.Optimizer = self.optimizer
            return inner

        def blockshard_layout_hash(self) -> str:
            return layout_hash(self.blockshard_layout())

        def state_dict(self) -> dict[str, Any]:
            sd: dict[str, Any] = super().state_dict()
            sd[LAYOUT_KEY] = {"hash": self.blockshard_layout_hash(), "layout": self.blockshard_layout()}
            return sd

        def load_state_dict(
            self,
            state_dict_list: list[dict[str, Any]],
            load_optimizer_states: bool = True,
            load_from_fp32_weights: bool = False,
            checkpoint_folder: str | None = None,
            load_serial: object = None,
            param_shapes: object = None,
        ) -> None:
            if checkpoint_folder:
                raise DeepSpeedHookError(
                    "universal checkpoints are not supported with blockshard's DeepSpeed hook "
                    "(they assume one flat optimizer state per param_group)"
                )
            if load_optimizer_states or load_from_fp32_weights:
                rank = dist.get_rank(group=self.dp_process_group)
                saved = state_dict_list[rank].get(LAYOUT_KEY) if rank < len(state_dict_list) else None
                mine = self.blockshard_layout_hash()
                if (
                    saved is None
                    or saved.get("hash") != mine
                    or len(state_dict_list) != dist.get_world_size(group=self.dp_process_group)
                ):
                    got = (
                        "no blockshard layout (saved without the hook)"
                        if saved is None
                        else f"layout {saved.get('hash')} on {len(state_dict_list)} ranks"
                    )
                    raise DeepSpeedHookError(
                        f"the ZeRO checkpoint has {got}, but this engine has layout {mine} on "
                        f"{dist.get_world_size(group=self.dp_process_group)} ranks: optimizer state and fp32 "
                        "partitions are laid out per world size, semantics and parameter set. Load with the same "
                        "ones, or pass load_optimizer_states=False (and zero_optimization.load_from_fp32_weights="
                        "false) for a module-only warm start"
                    )
            super().load_state_dict(  # DeepSpeed's returns None
                state_dict_list,
                load_optimizer_states=load_optimizer_states,
                load_from_fp32_weights=load_from_fp32_weights,
                checkpoint_folder=checkpoint_folder,
                load_serial=load_serial,
                param_shapes=param_shapes,
            )

    return BlockshardZeroOptimizer


def _needs_whole_matrices(optimizer: Any, inner_name: str, gindex: int) -> bool:
    """Whether param_group ``gindex``'s optimizer computes on whole matrices (Muon): by the semantics
    an optimizer states per group ([Note: Muon beside AdamW]), else by its name."""
    per_group = getattr(optimizer, "blockshard_group_semantics", None)
    if callable(per_group):
        return bool(per_group(gindex) == "matrix")
    return "muon" in inner_name
