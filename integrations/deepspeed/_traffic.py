"""Counters on DeepSpeed ZeRO-1/2's collectives under the hook ([Note: traffic] in
``blockshard/runtime/core/_traffic.py``).

DeepSpeed 0.19.8 issues the hooked optimizer's collectives through ``deepspeed.comm`` (imported as
``dist`` in ``stage_1_and_2.py`` and ``runtime/utils.py``, looked up at each call). While the hook's
optimizer runs one of its own reduction or gather methods, :meth:`HookTraffic.tap` puts counting
wrappers in place of ``deepspeed.comm.all_reduce``, ``reduce`` and ``all_gather_into_tensor``
(and the originals back when the method returns; DeepSpeed runs one rank per process). Nothing is
counted outside those methods.

What the plan predicts (the layout is the planner's :func:`~blockshard.planner.ordered_layout`):

* **the parameter all-gather** after each step, one per ``param_group``: ``all_gather_into_tensor``
  into the group's flat 16-bit (or fp32) buffer, ``W * S`` elements of the group's dtype -- the
  bytes ``blockshard.report`` shows as the group's partitions over all ranks. Checked per call.
* **the gradient reduction**, one round per backward that reduces (every micro-step under ZeRO-2,
  the accumulation boundary under ZeRO-1): every element of every gradient DeepSpeed was handed
  once, in its communication dtype, unpadded -- ``sum(numel) * itemsize`` -- as all-reduces of
  buckets (DeepSpeed's default ``use_multi_rank_bucket_allreduce``) or reduces to the owning rank
  (that switch off). DeepSpeed cuts the buckets where it chooses, so the round is checked as a
  whole, at ``independent_gradient_partition_epilogue``.

DeepSpeed's scalar reductions in ``step`` (the global gradient norm, fp16's overflow flag: a few
bytes) are not counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from blockshard.runtime.core._traffic import Traffic, log_step_summary

__all__ = ["HookTraffic"]

_CAUSE = (
    "DeepSpeed sent other bytes than the hook's layout plans (a gradient reduced twice or in another dtype, "
    "a padded bucket: please report it with blockshard.report(engine, optimizers=[engine.optimizer]) and "
    "blockshard.collective_counts(engine))"
)
_ALL_GATHER, _ALL_REDUCE, _REDUCE = 0, 2, 4


class HookTraffic:
    """The hooked ZeRO optimizer's counters and its ``deepspeed.comm`` tap."""

    def __init__(self, engine_name: str, reduce_kind_is_reduce: bool) -> None:
        self.traffic = Traffic(cause=_CAUSE)
        self.name = engine_name
        self.steps = 0
        self.round: dict[torch.dtype, int] = {}  # bytes DeepSpeed was handed to reduce this round, by dtype
        self._reduce_kind = _REDUCE if reduce_kind_is_reduce else _ALL_REDUCE
        self._depth = 0
        self._gathers: list[tuple[torch.Tensor, int, str]] = []  # (flat buffer, planned bytes, where)

    def plan_gathers(self, gathers: list[tuple[torch.Tensor, int, str]]) -> None:
        self._gathers = gathers

    def handed(self, param: torch.Tensor, dtype: torch.dtype) -> None:
        """DeepSpeed takes ``param``'s gradient into a bucket, to reduce in ``dtype``."""
        self.round[dtype] = self.round.get(dtype, 0) + param.numel() * dtype.itemsize

    def end_round(self) -> None:
        """A reduction round ended: its calls against what it was handed."""
        for dtype, planned in self.round.items():
            self.traffic.settle(f"{self.name}'s gradient reduction", self._reduce_kind, planned, dtype)
        self.round = {}

    def end_step(self) -> None:
        self.steps += 1
        moved, planned = self.traffic.take_step()
        log_step_summary(self.name, self.steps, moved, planned, subject=f"the {self.name} engine")

    @contextlib.contextmanager
    def tap(self, what: str) -> Iterator[None]:
        """Count ``what`` ("gradients": every all-reduce and reduce; "gather": the all-gathers into
        the flat buffers) that DeepSpeed issues through ``deepspeed.comm`` inside the block."""
        import deepspeed.comm as ds_comm

        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        names = ("all_reduce", "reduce") if what == "gradients" else ("all_gather_into_tensor",)
        saved = {n: getattr(ds_comm, n) for n in names}
        for n, fn in saved.items():
            setattr(ds_comm, n, self._counting(n, fn))
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            for n, fn in saved.items():
                setattr(ds_comm, n, fn)

    def _counting(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        step = self.steps + 1

        def counted(*args: Any, **kwargs: Any) -> Any:
            if name == "all_gather_into_tensor":
                out = args[0] if args else kwargs.get("output_tensor")
                for flat, planned, where in self._gathers:
                    if out is flat:
                        nbytes = out.numel() * out.element_size()
                        self.traffic.record(where, _ALL_GATHER, nbytes, planned, out.dtype, "float", step)
            else:
                t = args[0] if args else kwargs.get("tensor")
                if isinstance(t, torch.Tensor):
                    kind = _ALL_REDUCE if name == "all_reduce" else _REDUCE
                    self.traffic.record(
                        f"{self.name}'s gradient bucket",
                        kind,
                        t.numel() * t.element_size(),
                        None,
                        t.dtype,
                        "float",
                        step,
                    )
            return fn(*args, **kwargs)

        return counted
