"""``BufferSet``: what the engine core asks of every set of buffers a group holds.

[Note: buffer sets]
A group (the tensors of one ``fully_shard`` call) keeps its tensors in one or more *buffer sets*,
each with its own layout, its own :class:`ShardedState` and its own collectives:
  * :class:`~blockshard.runtime.core._buffers.ParamBuffers`: the group's parameters of one dtype,
    views of a local and a gathered buffer ([Note: buffers] in _buffers.py). The trainable dtype's
    is the group's *primary* buffer set (``ModuleState.buffers``); each other dtype's holds frozen
    parameters ([Note: mixed dtypes] in _dtypes.py);
  * ``QuantizedGatherBuffers`` (``runtime/quantized/_gather.py``): trainable float masters
    all-gathered as quantized tiles ([Note: quantized gather]);
  * ``FrozenQuantizedBuffers`` (``runtime/quantized/_frozen.py``): frozen quantized weights sharded
    as bytes ([Note: frozen quantized buffers]).
``fully_shard`` (the composition root, which alone knows every kind) makes them and gives them to
the group's :class:`~blockshard.runtime.core._state.ModuleState` as one ordered list,
``buffer_sets``: the frozen quantized weights first, then the primary, then the other dtypes, then
the quantized gather. The engine core knows only this interface and walks that list at every hook
of a step (issue every unshard, then wait for each; reshard; reduce the ones that train; check
before a forward; drop an interrupted step), in the same order on every rank, so the collectives
line up. Each buffer set counts its own collectives in the root context's tally
([Note: collective integrity] in _collectives.py) under its group's index.

Per-step state is dropped in one place each: a buffer set's in :meth:`BufferSet.reset_step` (what
an interrupted step leaves: gradients not reduced yet, a reduction in flight), a module state's
in ``ModuleState._to_idle``. The FSDP2 controls of a group (``set_requires_gradient_sync`` and the
others) are one :class:`GroupControls` shared by the group's state and its buffer sets.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from blockshard._errors import EngineStateError
from blockshard.runtime.core._collectives import agree, wait
from blockshard.runtime.core._common import CollectiveTally, ShardedState
from blockshard.runtime.core._traffic import CollectiveCount, Traffic

__all__ = ["BufferSet", "GroupControls"]


@dataclass(eq=False)
class GroupControls:
    """One group's FSDP2 controls (``ShardedModule``'s setters, _module.py), read by its module
    state and by the buffer sets that reduce gradients."""

    requires_gradient_sync: bool = True  # off: backward accumulates without a reduce-scatter
    reshard_after_backward: bool = True
    requires_all_reduce: bool = True  # HSDP only ([Note: HSDP] in _grad_sync.py)
    divide_factor: float | None = None  # set_gradient_divide_factor: the sum / factor, not the average
    # set_gradient_views: unsharded gradients as views of the reduce-scatter input; None: where the
    # backend reduces it in place ([Note: gradient views] in _grad_sync.py)
    gradient_views: bool | None = None
    # FSDP2's communication controls ([Note: communication controls] in _module_comms.py)
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    all_reduce_hook_stream: Any = None
    force_sum: bool = False  # set_force_sum_reduction_for_comms: SUM, then the engine divides
    reduce_scatter_unused_params: bool = False  # every trainable parameter gets the reduced .grad


class BufferSet(abc.ABC):
    """One buffer set of a group ([Note: buffer sets]): unshard, wait, reshard, and, where its
    tensors train, reduce their gradients."""

    def __init__(self, name: str, process_group: dist.ProcessGroup) -> None:
        self.name, self.process_group = name, process_group
        self.rank, self.world_size = process_group.rank(), process_group.size()
        self.sharded_state = ShardedState.SHARDED
        # set at the root's first forward: the module's path under the root, and where this buffer
        # set's collectives are counted ([Note: collective integrity])
        self.path: str | None = None
        self.tally: CollectiveTally | None = None
        self.tally_index = 0
        self.root: Callable[[], Any] | None = None  # a weakref.ref to the RootContext (the optimizer checks)
        self._pending: list[dist.Work] = []  # the unshard's all-gathers in flight, while UNSHARDING
        self.traffic = Traffic()  # [Note: traffic]

    @property
    def described(self) -> str:
        """The buffer set in messages: its name and, once known, its module's path under the root."""
        where = "" if self.path is None else f" ({self.path or 'the root'})"
        return f"{self.name!r}{where}"

    def agree(self, what: str, numel: int, dtype: torch.dtype, group: dist.ProcessGroup | None = None) -> None:
        """Before issuing ``what`` (on ``group``, by default this buffer set's): every rank is about
        to issue the same, in the same phase of the step ([Note: collective headers])."""
        phase = "" if self.tally is None else self.tally.phase_text
        controls: GroupControls | None = getattr(self, "controls", None)  # buffer sets that train have them
        sync = None if controls is None else controls.requires_gradient_sync
        agree(self.process_group if group is None else group, what, numel=numel, dtype=dtype, phase=phase, sync=sync)

    def count(self, kind: int) -> None:
        """Count one collective of ``kind`` (0 all-gather, 1 reduce-scatter, 2 all-reduce)."""
        if self.tally is not None:
            self.tally.record(self.tally_index, kind)

    def sent(
        self, kind: int, nbytes: int, predicted: int, dtype: torch.dtype, wire: str = "float", ranks: int | None = None
    ) -> None:
        """Record one collective of ``kind`` that moves ``nbytes`` where the plan predicts
        ``predicted`` ([Note: traffic]); call it where the collective is issued. ``ranks``: the
        size of the process group it runs over, if not this buffer set's (the ``k``-group of
        [Note: reshard to a smaller world] in _post_forward.py)."""
        step = 1 if self.tally is None else self.tally.steps + 1
        planned = self.gather_wire if kind == 0 else None
        over = self.world_size if ranks is None else ranks
        self.traffic.record(self.described, kind, nbytes, predicted, dtype, wire, step, planned, ranks=over)

    @property
    def gather_wire(self) -> str:
        """The wire format this buffer set's all-gather is planned in ([Note: traffic])."""
        return "float"

    def collective_counts(self) -> list[CollectiveCount]:
        """This buffer set's collectives since it was built ([Note: traffic])."""
        return self.traffic.counts(self.path if self.path is not None else self.name, self.name)

    # -- all-gather -------------------------------------------------------------------------------
    @abc.abstractmethod
    def unshard(self, *, async_op: bool = False) -> None:
        """Issue the all-gather (SHARDED -> UNSHARDING) and wait for it unless ``async_op``
        (-> UNSHARDED); nothing to do unless SHARDED."""

    def wait_unshard(self) -> None:
        """Finish an unshard (issuing it first if nobody did): the modules hold full tensors."""
        if self.sharded_state is ShardedState.UNSHARDED:
            return
        if self.sharded_state is ShardedState.SHARDED:
            self.unshard()
            return
        for work in self._pending:
            wait(work, self.gather_what, self.process_group)
        self._pending.clear()
        self._finish_unshard()
        self.sharded_state = ShardedState.UNSHARDED

    @property
    def gather_what(self) -> str:
        """The all-gather in messages (a timeout, a failed peer)."""
        return f"the all-gather of {self.described}"

    @abc.abstractmethod
    def _finish_unshard(self) -> None:
        """Once the all-gathers completed: fill what the modules read, give them the full tensors."""

    @abc.abstractmethod
    def reshard(self) -> None:
        """Free the gathered storage; the modules hold their local pieces again (-> SHARDED)."""

    @property
    def gathers_on_copies(self) -> bool:
        """Whether an all-gather of it in flight holds a second copy of the gathered buffer (gloo on
        the CPU: [Note: gloo's copies]), so a prefetch issued in backward is waited for at once."""
        return False

    def check_forward(self) -> None:
        """Raise before a forward if the modules' tensors changed in a way the engine cannot follow."""
        return None  # nothing the engine cannot follow, unless a kind says otherwise

    def reset_step(self) -> None:
        """Drop what an interrupted step left ([Note: buffer sets]); the caller reshards next."""
        return None  # no per-step state, unless a kind keeps some

    # -- gradients: only a buffer set that ``trains`` is asked to reduce ---------------------------
    @property
    def trains(self) -> bool:
        """Whether backward reduces this buffer set's gradients (its tensors may train)."""
        return False

    def prepare_grads(self) -> None:
        """This backward is about to reach the unsharded parameters: give them their gradient views."""
        raise self._frozen("prepare_grads")

    def accumulate_grads(self) -> None:
        """Backward without gradient sync: keep the unsharded gradients for the next backward."""
        raise self._frozen("accumulate_grads")

    def reduce_grads(self) -> None:
        """Issue the reduce-scatter of the unsharded gradients (asynchronously)."""
        raise self._frozen("reduce_grads")

    def reached_without_grads(self) -> bool:
        """A backward reached these tensors since their last reduction, and none got a gradient."""
        raise self._frozen("reached_without_grads")

    @property
    def reducing(self) -> bool:
        """A reduce-scatter of this buffer set is in flight (issued, not waited for)."""
        return False

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter in flight and point the sharded ``.grad`` at the result."""
        raise self._frozen("finish_reduce")

    def _frozen(self, what: str) -> EngineStateError:
        return EngineStateError(f"{what} of buffer set {self.described}, which does not train (a bug in the engine)")
