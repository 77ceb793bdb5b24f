"""The engine's two state machines and the checks on their transitions.

[Note: state machines]
Each sharded module's state (``ModuleState``) has a :class:`TrainingState`; each group of
parameters (``ParamBuffers``) has a :class:`ShardedState`. A step walks them like this (one module,
``reshard_after_forward=True``; arrows are hook calls):

    TrainingState:  IDLE --pre_forward--> FORWARD --post_forward--> IDLE
                    IDLE --pre_backward--> PRE_BACKWARD --all grads in--> POST_BACKWARD
                    (PRE_BACKWARD | POST_BACKWARD | IDLE) --final callback--> IDLE
    ShardedState:   SHARDED --unshard(async)--> UNSHARDING --wait--> UNSHARDED --reshard--> SHARDED
                    SHARDED --unshard(sync)--> UNSHARDED

A forward that runs *inside* backward is an activation-checkpoint recompute (see
[Note: recompute] in ``_state.py``): it changes no state, prefetches nothing and reshards nothing.
Transitions are checked with :func:`expect`; a failed check is a bug in the engine or a hook
order torch did not promise, never a user error, so it raises :class:`EngineStateError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from blockshard._errors import EngineStateError

__all__ = [
    "CollectiveTally",
    "DeviceStreams",
    "EngineStateError",
    "ShardedState",
    "TrainingState",
    "expect",
    "in_backward",
    "tensors_in",
]


class TrainingState(enum.Enum):
    """Where one sharded module is in the step."""

    IDLE = "idle"  # between forwards, or after its backward finished
    FORWARD = "forward"  # between its pre-forward and post-forward hooks
    PRE_BACKWARD = "pre_backward"  # gradients reached its outputs; its parameters' are arriving
    POST_BACKWARD = "post_backward"  # all its gradients arrived and were reduced


class ShardedState(enum.Enum):
    """What the parameters of one group are."""

    SHARDED = "sharded"  # the module holds the local pieces; the gathered storage is freed
    UNSHARDING = "unsharding"  # all-gathers issued, not yet waited for
    UNSHARDED = "unsharded"  # the module holds the full parameters (views of the gathered buffer)


def expect(what: str, current: enum.Enum, *allowed: enum.Enum) -> None:
    """Raise :class:`EngineStateError` unless ``current`` is one of ``allowed``."""
    if current not in allowed:
        names = " or ".join(a.name for a in allowed)
        raise EngineStateError(f"{what}: expected state {names}, found {current.name}")


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread.

    torch has no public query for this; FSDP2 (``_fsdp_common.is_bw``) and
    ``torch.utils.module_tracker`` use the same call.
    """
    return torch._C._current_graph_task_id() != -1


def eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` run eagerly under ``torch.compile``: a compiled module's graph holds its forward
    alone, the engine's hooks run around it (what FSDP2's ``_dynamo_disable`` does for its hooks)."""
    disabled: Callable[..., Any] = torch._dynamo.disable(
        hook, recursive=True, reason="blockshard's engine hooks run eagerly"
    )
    return disabled


def tensors_in(obj: object) -> list[torch.Tensor]:
    """The tensors in a module's inputs or outputs: pytree containers (tuples, lists, dicts, Hugging
    Face ``ModelOutput``) and dataclass fields, at any depth."""
    out: list[torch.Tensor] = []
    stack, seen = [obj], set()
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            if id(x) not in seen:
                seen.add(id(x))
                stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))
        else:
            leaves, _ = tree_flatten(x)
            if not (len(leaves) == 1 and leaves[0] is x):
                stack.extend(leaves)
    return out


class CollectiveTally:
    """The collectives one root context issued in the current step, as a count and an
    order-sensitive hash of (group index, kind), plus the steps so far ([Note: collective integrity])."""

    _MOD = (1 << 61) - 1

    def __init__(self) -> None:
        self.steps = 0
        self.count = 0
        self.hash = 0
        self.optimizer_steps = 0  # end-of-step checks after which an optimizer had stepped
        self.optimizer_stepped = False  # set by the optimizer guard's step pre-hook (_optim_guard.py)
        # where the root's step is, for the headers ([Note: collective headers] in _collectives.py)
        self.phase = "between"  # "forward", "backward", "end" (the end-of-step check) or "between"
        self.forwards = 0  # the root's forwards since the last end-of-step check

    @property
    def phase_text(self) -> str:
        """The phase in headers and messages; the ranks compare its kind (:func:`phase_kind`)."""
        step = self.steps + 1
        if self.phase == "forward":
            return f"in the forward ({_ordinal(self.forwards)} since the last backward) of step {step}"
        if self.phase == "backward":
            return f"in the backward of step {step}"
        if self.phase == "end":
            return f"at the end of step {step}"
        return f"between steps ({self.steps} done)"

    def forward_started(self) -> None:
        self.phase, self.forwards = "forward", self.forwards + 1

    def backward_started(self) -> None:
        self.phase = "backward"

    def record(self, index: int, kind: int) -> None:
        self.count += 1
        self.hash = (self.hash * 1_000_003 + 3 * index + kind + 1) % self._MOD  # kind: 0, 1 or 2

    def reset(self) -> None:
        self.count, self.hash = 0, 0
        self.phase, self.forwards = "between", 0


def phase_kind(phase_text: str) -> str:
    """What the ranks compare of a :attr:`CollectiveTally.phase_text`: forward, backward, end or
    between (not the forward's number: a forward that issues no collective, all gathered already,
    pairs with nothing)."""
    for kind in ("forward", "backward", "end", "between"):
        if kind in phase_text.split(" ", 3)[:3]:
            return kind
    return phase_text


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


class DeviceStreams:
    """[Note: streams] Where a group's collectives run, as FSDP2's (``_fsdp_param_group.py``).

    On CUDA the all-gathers (with the copy of the local shard into the send buffer) run on an
    all-gather stream and the reduce-scatters (and HSDP's all-reduce) on a reduce-scatter stream,
    each after waiting for the current stream (the optimizer step wrote the shard, backward the
    gradients); an event recorded after issuing makes the current stream wait before the gathered
    parameters or the reduced gradient are used. Every buffer is allocated on the current stream
    and freed only after it waited, so the caching allocator never hands out memory a collective
    still writes. With ``pinned`` (CPU offload), gradient copies to the host are non-blocking and
    synchronized at the end of the reduction, before backward returns.
    Anywhere but CUDA (the CPU, on gloo) every method is a no-op: the collectives run where they
    are issued, and ``Work.wait`` orders them. The CUDA branch has not run yet (no GPU here).
    """

    def __init__(self, device: torch.device, *, pinned: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.pinned = pinned and self.cuda
        self._streams: dict[str, Any] = {}
        self._events: dict[str, Any] = {}
        self._device = device

    @contextlib.contextmanager
    def on(self, kind: str) -> Iterator[None]:
        """Run the collectives issued inside on ``kind``'s stream ("all_gather", "reduce_scatter")."""
        if not self.cuda:
            yield
            return
        stream = self._streams.get(kind)
        if stream is None:
            stream = self._streams[kind] = torch.cuda.Stream(self._device)
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            yield
            self._events[kind] = torch.cuda.current_stream(self._device).record_event()

    def current_waits(self, kind: str) -> None:
        """The current stream waits for what :meth:`on` issued last on ``kind``'s stream."""
        event = self._events.pop(kind, None)
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)

    def host_copies_done(self) -> None:
        """Non-blocking copies to pinned host memory have landed (the CPU reads them next)."""
        if self.pinned:
            torch.cuda.current_stream(self._device).synchronize()
