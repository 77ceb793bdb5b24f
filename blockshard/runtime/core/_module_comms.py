"""FSDP2's communication controls of ``FSDPModule`` (torch 2.13 ``_fully_shard.py``) on a
``ShardedModule``: the ones that change what the engine computes behave as FSDP2's; the ones that
tune how FSDP2 allocates or schedules its collectives' staging buffers have nothing to tune in
blockshard's engine (its buffers are persistent: the gathered buffer is the parameters) and are
accepted after their arguments are checked, as FSDP2 accepts them on backends that ignore them;
the custom collectives raise, naming why ([Note: communication controls]).

[Note: communication controls]
* ``set_all_reduce_hook(hook)``: ``hook(output)`` runs on each buffer set's reduce-scatter output
  (after HSDP's all-reduce) before it becomes the sharded ``.grad``, as FSDP2's (before its divide).
* ``set_force_sum_reduction_for_comms(True)``: the collectives reduce with ``SUM`` and the engine
  divides by the number of data-parallel ranks afterwards (FSDP2's post-divide), not ``AVG``.
* ``set_reduce_scatter_unused_params(True)``: a parameter that got no gradient on this rank gets
  the reduced one (zeros where no rank had one) as its ``.grad``, so ranks whose control flow uses
  different parameters (mixture of experts) all step them. The engine always sends zeros for such
  parameters (every rank issues the same collectives); by default it leaves their ``.grad`` None,
  and the end-of-step check refuses ranks that differ in which parameters got one.
* accepted, nothing to change: ``set_reduce_scatter_max_input_buffers`` (one reduce-scatter is in
  flight per buffer set; on gloo its input is a clone owned by the collective),
  ``set_separate_reduce_scatter_group`` (the reduce-scatters share the engine's group with the
  all-gathers), ``set_allocate_memory_from_process_group_for_comm`` and ``set_symm_mem_for_comm``
  (no staging buffers are allocated per collective).
* ``set_custom_all_gather`` / ``set_custom_reduce_scatter``: refused; the engine's collectives carry
  its size checks and timeouts ([Note: collective integrity]) that a custom one would bypass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from blockshard._errors import ShardingError
from blockshard.runtime.core._state import ModuleState

__all__ = ["CommControls"]


class CommControls:
    """The communication controls of :class:`~blockshard.runtime.ShardedModule` ([Note:
    communication controls])."""

    def _bs_state(self) -> ModuleState:
        raise NotImplementedError

    def _states(self, recurse: bool) -> list[ModuleState]:
        raise NotImplementedError

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Run ``hook(output)`` on this group's reduce-scatter output (after HSDP's all-reduce)
        before it becomes the sharded gradients; ``stream``: a CUDA stream to run it on (not with
        HSDP, as FSDP2)."""
        if not callable(hook):
            raise ShardingError(f"set_all_reduce_hook(hook={hook!r}): pass a callable hook(output: torch.Tensor)")
        state = self._bs_state()
        if stream is not None and any(b.replicate_group is not None for b in state.param_buffers):
            raise ShardingError(
                "set_all_reduce_hook(..., stream=...): stream cannot be set when using HSDP (the hook runs after the "
                "HSDP all-reduce, on its stream), as in FSDP2. Fix: leave stream unset"
            )
        state.controls.all_reduce_hook, state.controls.all_reduce_hook_stream = hook, stream

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """On: reduce with ``SUM`` and divide afterwards, never ``AVG`` (this module's group)."""
        _check_flag("set_force_sum_reduction_for_comms", "enable", enable)
        self._bs_state().controls.force_sum = enable

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """On: a parameter without a gradient on this rank still gets the reduced gradient (zeros
        where no rank had one), for ranks whose control flow uses different parameters."""
        _check_flag("set_reduce_scatter_unused_params", "reduce_scatter_unused_params", reduce_scatter_unused_params)
        for st in self._states(recurse):
            st.controls.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Accepted, nothing to change: one reduce-scatter is in flight per buffer set, waited for
        at the next group's post-backward ([Note: async reduce-scatter] in _grad_sync.py)."""
        message = f"set_reduce_scatter_max_input_buffers(max_input_buffers={max_input_buffers!r}): pass an int >= 1"
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(message)  # a TypeError, as FSDP2's (2.5 or True: no count of buffers)
        if max_input_buffers < 1:
            raise ShardingError(message)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Accepted, nothing to change: the reduce-scatters run on the engine's group, as its
        all-gathers (on gloo a group of its own beside the user's, [Note: collective integrity])."""
        _check_flag("set_separate_reduce_scatter_group", "enable", enable)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted, nothing to change: the engine allocates no staging buffer per collective (the
        gathered buffer is the parameters, the reduce-scatter input their gradients)."""
        _check_flag("set_allocate_memory_from_process_group_for_comm", "enable", enable)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted, nothing to change (no staging buffers, as above); ``backend``: ``"NCCL"``, as FSDP2."""
        if backend != "NCCL":
            raise ShardingError(f"set_symm_mem_for_comm(backend={backend!r}): only 'NCCL' is supported, as in FSDP2")

    def set_custom_all_gather(self, comm: object) -> None:
        """Refused: see [Note: communication controls]."""
        _no_custom("set_custom_all_gather", "all-gather")

    def set_custom_reduce_scatter(self, comm: object) -> None:
        """Refused: see [Note: communication controls]."""
        _no_custom("set_custom_reduce_scatter", "reduce-scatter")


def _check_flag(method: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ShardingError(f"{method}({name}={value!r}): pass True or False")


def _no_custom(method: str, what: str) -> None:
    raise ShardingError(
        f"{method}: blockshard's engine issues its own {what}s, on persistent buffers and with the size checks "
        "and timeouts that keep ranks from hanging on mismatched collectives, which a custom one would bypass; "
        "it does not take a custom one. Fix: leave it unset, or shard this model with torch's fully_shard"
    )
