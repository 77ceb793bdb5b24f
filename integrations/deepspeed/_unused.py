"""Which parameters got no gradient in an optimizer step, on any rank.

[Note: unused parameters]
On one process a parameter that gets no gradient in a step (a layer the step's forward skips, a
head that a loss does not reach) has ``grad is None`` and torch's / bitsandbytes' optimizers skip it:
no weight decay, no moment decay, no step count. DeepSpeed 0.19.8 never hears of it: ZeRO-1/2 hand
the inner optimizer zeros for it (``ignore_unused_parameters``), ZeRO-3 its gradient partition as the
last step that used it left it (never cleared between steps), so the optimizer steps it anyway.

With ``"unused_parameters": "exact"`` (the default) the hooks make this exact where the inner
optimizer steps each parameter on its own: a ``post_accumulate_grad`` hook on every trainable
parameter records the ones autograd gave a gradient in the step's micro-batches, one ``all_reduce``
(MAX, one int32 per parameter) per optimizer step tells every rank which ones no rank used (started
asynchronously when the step begins, waited for where the first parameter steps, so it overlaps
DeepSpeed's gradient-norm and overflow checks), and those
step with ``grad = None``: the ZeRO-1/2 hook's per-parameter views, the ZeRO-3 owners' run tensors
([Note: ZeRO-3 unused parameters] in _stage3.py). Where one flat tensor holds many parameters' state
(ZeRO-3 with an element-wise optimizer, stepped as stock DeepSpeed steps it) a parameter cannot be
skipped alone, so a step in which one was unused everywhere raises a :class:`DeepSpeedHookError` on
every rank, naming it, before anything is stepped. ``"stock"`` leaves DeepSpeed's own update (no
hooks, no collective).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["UsedParameters"]


class UsedParameters:
    """Records which of ``params`` autograd gave a gradient since :meth:`clear`."""

    def __init__(self, params: Sequence[torch.Tensor], hooks: list[Any]) -> None:
        self._index = {id(p): k for k, p in enumerate(params)}
        self._n = len(params)
        self._used: set[int] = set()
        for p in params:
            if p.requires_grad:  # the hook's handle goes where DeepSpeed's destroy() removes its own
                hooks.append(p.register_post_accumulate_grad_hook(self._record))

    def _record(self, p: torch.Tensor) -> None:
        self._used.add(self._index[id(p)])

    def unused_everywhere(self, group: Any, device: torch.device) -> Callable[[], set[int]]:
        """Start the all_reduce (every rank calls it; asynchronous, so it overlaps what the step does
        before it needs the answer) and return a function that waits for it and gives the indices
        of the parameters no rank of ``group`` recorded."""
        flags = torch.zeros(self._n, dtype=torch.int32, device=device)
        if self._used:
            flags[sorted(self._used)] = 1
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
        answer: list[set[int]] = []

        def wait() -> set[int]:
            if not answer:
                if work is not None:
                    work.wait()
                answer.append({k for k, f in enumerate(flags.tolist()) if not f})
            return answer[0]

        return wait

    def clear(self) -> None:
        self._used.clear()
