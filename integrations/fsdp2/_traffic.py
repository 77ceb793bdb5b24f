"""Counters on stock FSDP2's collectives under the adapter ([Note: traffic] in
``blockshard/runtime/core/_traffic.py``).

FSDP2 (torch 2.13 and 2.14, ``_fsdp_collectives.py``) issues each group's all-gather and
reduce-scatter through the group's comm objects, which the public
``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` replace. The adapter's
:func:`~blockshard.integrations.fsdp2.fully_shard` sets counting subclasses of torch's defaults
(``DefaultAllGather``, ``DefaultReduceScatter``): the same allocation and the same call, one dict
update more. FSDP2's own checks that a group's comm is its default
(``set_allocate_memory_from_process_group_for_comm``, ``set_symm_mem_for_comm``) still pass; they
put torch's comm in place of the counter, and counting stops there (nothing else changes). A user's
``set_custom_all_gather`` after the adapter's does the same.

The plan each call is checked against is the adapter's, not FSDP2's arithmetic: a parameter placed
``Shard(d)`` over ``W`` ranks is padded along ``d`` to ``W * ceil(size(d) / W)``
rows, so a group's all-gather moves ``W * sum(ceil(size(d) / W) * numel / size(d))`` elements in the
mixed-precision policy's ``param_dtype`` (else each parameter's own dtype) -- the bytes
``blockshard.report`` shows as held plus padding -- and its reduce-scatter the same over the
parameters that require a gradient, in ``reduce_dtype`` (else the ``param_dtype``, else the
parameter's). ``W`` is the mesh's shard dimension, also for the backward's all-gather over the
smaller group of an int ``reshard_after_forward`` (FSDP2 keeps the ``W``-padded sizes there: measured
at W = 4 with 2, the same bytes as a full all-gather). A trainable parameter that got
no gradient in a step is left out of FSDP2's reduce-scatter and shows as a mismatch.

Steps are counted per root (the adapter's ``root=``, default the sharded module): a step ends with
the backward that reduce-scattered (an autograd final callback queued at its first
reduce-scatter, run after FSDP2's own), which logs the step's summary under ``BLOCKSHARD_LOG=info``.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from blockshard.runtime.core._traffic import Traffic, log_step_summary, tag_traffic

__all__ = ["count_collectives"]

_CAUSE = (
    "FSDP2 sent other bytes than the adapter's plan (a trainable parameter that got no gradient this step is "
    "left out of FSDP2's reduce-scatter; else FSDP2 pads otherwise in this torch release: please report it with "
    "blockshard.report(model) and blockshard.collective_counts(model))"
)


@dataclass(eq=False)
class _Root:
    """The steps of every adapter group under one root."""

    name: str
    steps: int = 0  # backwards that reduce-scattered
    queued: bool = False
    groups: list[Traffic] = field(default_factory=list)

    def on_reduce_scatter(self) -> None:
        if self.queued or torch._C._current_graph_task_id() == -1:  # outside backward: no step end to wait for
            return
        self.queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self.end_step)

    def end_step(self) -> None:
        self.queued = False
        self.steps += 1
        totals: dict[str, int] = {}
        predicted: dict[str, int] = {}
        for t in self.groups:
            moved, planned = t.take_step()
            for kind, n in moved.items():
                totals[kind] = totals.get(kind, 0) + n
            for kind, n in planned.items():
                predicted[kind] = predicted.get(kind, 0) + n
        log_step_summary(self.name, self.steps, totals, predicted)


_ROOTS: weakref.WeakKeyDictionary[nn.Module, _Root] = weakref.WeakKeyDictionary()


def _root_of(root: nn.Module) -> _Root:
    found = _ROOTS.get(root)
    if found is None:  # FSDP2 renames a sharded module's class FSDP<name>
        name = type(root).__name__
        found = _ROOTS[root] = _Root(name.removeprefix("FSDP") if isinstance(root, FSDPModule) else name)
    return found


def _padded_numel(p: DTensor, world_size: int) -> int:
    (placement,) = p.placements
    dim = getattr(placement, "dim", 0)
    shape = tuple(p.shape)
    if not shape:
        return world_size  # a 0-d parameter: FSDP2 shards it as one row
    rows = shape[dim]
    return world_size * -(-rows // world_size) * (math.prod(shape) // rows if rows else 0)


def _comm_classes() -> tuple[type, type] | None:
    """torch's default FSDP2 comms, or ``None`` where this torch has none (then nothing is counted)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    except ImportError:
        return None
    return DefaultAllGather, DefaultReduceScatter


def count_collectives(
    out: FSDPModule, params: list[DTensor], root: nn.Module, world_size: int, mp_policy: object | None
) -> Traffic | None:
    """Put counting comms on the FSDP2 module ``out`` (its ``params`` sharded over ``world_size``
    by this call) and tag it with their counters; ``None`` where FSDP2 takes no custom comm here
    (no parameter, several parameter groups, a torch without the default comms)."""
    classes = _comm_classes()
    if not params or classes is None or not isinstance(out, nn.Module):
        return None
    default_ag, default_rs = classes
    traffic = Traffic(cause=_CAUSE)
    steps = _root_of(root)
    path = next((n for n, m in root.named_modules() if m is out), None)
    where = f"FSDP2 group {path!r}" if path else "FSDP2 root group"
    refs = [weakref.ref(p) for p in params]
    param_dtype = getattr(mp_policy, "param_dtype", None)
    reduce_dtype = getattr(mp_policy, "reduce_dtype", None)

    def live() -> list[DTensor]:
        return [p for r in refs if (p := r()) is not None]

    def predicted(dtype_of: Callable[[DTensor], torch.dtype], grads_only: bool) -> int:
        """The plan's bytes of one collective: each parameter padded over the mesh's shard
        dimension, in its own dtype (FSDP2 gathers a group of mixed dtypes as bytes)."""
        return sum(
            _padded_numel(p, world_size) * dtype_of(p).itemsize for p in live() if p.requires_grad or not grads_only
        )

    def gather_dtype(p: DTensor) -> torch.dtype:
        return param_dtype if isinstance(param_dtype, torch.dtype) else p.dtype

    def grad_dtype(p: DTensor) -> torch.dtype:
        return reduce_dtype if isinstance(reduce_dtype, torch.dtype) else gather_dtype(p)

    class CountingAllGather(default_ag):  # type: ignore[misc,valid-type]
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            plan = predicted(gather_dtype, grads_only=False)
            nbytes = output_tensor.numel() * output_tensor.element_size()
            traffic.record(where, 0, nbytes, plan, output_tensor.dtype, "float", steps.steps + 1)
            return super().__call__(output_tensor, input_tensor, *args, **kwargs)

    class CountingReduceScatter(default_rs):  # type: ignore[misc,valid-type]
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            plan = predicted(grad_dtype, grads_only=True)
            nbytes = input_tensor.numel() * input_tensor.element_size()
            traffic.record(where, 1, nbytes, plan, input_tensor.dtype, "float", steps.steps + 1)
            steps.on_reduce_scatter()
            return super().__call__(output_tensor, input_tensor, *args, **kwargs)

    try:
        out.set_custom_all_gather(CountingAllGather())
        out.set_custom_reduce_scatter(CountingReduceScatter())
    except ValueError:  # several parameter groups (per-parameter meshes): FSDP2 takes no custom comm
        return None
    tag_traffic(out, "FSDP2", traffic)  # an FSDPModule is the nn.Module it was made from
    steps.groups.append(traffic)
    return traffic
