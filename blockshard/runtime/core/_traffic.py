"""What each buffer set sent, against what its plan says it sends, and the step log.

[Note: traffic]
Every collective a buffer set issues in training (its all-gather, reduce-scatter and, under HSDP,
all-reduce) is recorded where it is issued: its kind, the bytes of its full operand as the engine
passes it (the gathered output of an all-gather, the unreduced input of a reduce-scatter, summed
over the buckets; the local segment of an all-reduce), the dtype, and the wire format ("float",
"quantized payload" for a quantized gather, "quantized bytes" for frozen quantized weights). Next
to each, the bytes the plan predicts for one such collective: the layout's padded size times the
dtype the policy says it moves (``W * S * itemsize(param_dtype)`` for a float all-gather,
``itemsize(reduce_dtype)`` for a reduce-scatter, ``W * S_q`` for the quantized segments). The two
must agree: a collective that moves other bytes than its plan (a cast the policy did not ask for,
a bucket the layout does not hold, a quantized gather that sends floats) is a
:class:`~blockshard.runtime.TrafficMismatchError` under ``BLOCKSHARD_STRICT=1`` and a warning
otherwise, once per buffer set. The counters are plain integers, always on (one dict update per
collective); :func:`collective_counts` reads them, a row per kind, wire format, dtype and size of the
process group the calls ran over (the engine's buffer sets record it: their shard group's, or the
``k``-group of an int ``reshard_after_forward``, whose all-gather still fills the whole gathered
buffer and so moves the planned bytes; [Note: reshard to a smaller world] in _post_forward.py).

The adapters count another engine's collectives into the same counters, hung on the module they
count (:func:`tag_traffic`), against their own plan: the FSDP2 adapter's counting comms
(``integrations/fsdp2/_traffic.py``), the DeepSpeed hook's ``deepspeed.comm`` tap
(``integrations/deepspeed/_traffic.py``; its gradient buckets are checked per reduction round,
:meth:`Traffic.settle`, as DeepSpeed cuts them where it chooses).

The step log (``BLOCKSHARD_LOG=info`` or :func:`set_step_log`) writes each recorded collective of
the first ``BLOCKSHARD_LOG_STEPS`` (3) steps to the ``blockshard`` logger at INFO, and at each end
of backward one line per root: the step's bytes gathered and reduced against the plan's prediction
for the same collectives. Where nothing configured that logger, ``BLOCKSHARD_LOG`` gives it a
handler on stderr, so a launched script prints the lines.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from blockshard._errors import ShardingError
from blockshard.runtime.core._optim_checks import strict

__all__ = [
    "KINDS",
    "CollectiveCount",
    "StepLogError",
    "Traffic",
    "TrafficMismatchError",
    "log_on",
    "set_step_log",
    "step_log_steps",
    "tag_traffic",
    "tagged_traffic",
]

# the tally's kinds 0, 1, 2; owner compute's 3; DeepSpeed's gradient reduce to one rank 4
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "reduce")
LOG_ENV, STEPS_ENV = "BLOCKSHARD_LOG", "BLOCKSHARD_LOG_STEPS"
_DEFAULT_STEPS = 3
logger = logging.getLogger("blockshard")


class TrafficMismatchError(ShardingError):
    """A collective moved other bytes than its plan predicts ([Note: traffic])."""


class StepLogError(ShardingError):
    """``BLOCKSHARD_LOG`` / ``BLOCKSHARD_LOG_STEPS`` or :func:`set_step_log` got a value it does not take."""


@dataclass(frozen=True)
class CollectiveCount:
    """One buffer set's collectives of one kind and wire format, on this rank, since it was built."""

    group: str  # the module's path under the root ("" for the root), or the buffer set's name before the first forward
    buffer_set: str
    kind: str  # "all-gather", "reduce-scatter", "all-reduce", "all-to-all" (owner compute) or "reduce" (DeepSpeed)
    wire: str  # "float", "quantized payload" or "quantized bytes"
    dtype: str
    calls: int
    bytes: int  # summed over the calls: each call's full operand (see [Note: traffic])
    predicted_bytes: int  # the plan's figure for the same calls
    # the size of the process group the calls ran over, where the counter records it (the engine's
    # buffer sets do: W, or k for backward's all-gathers of an int reshard_after_forward); else None
    ranks: int | None = None

    @property
    def agrees(self) -> bool:
        return self.bytes == self.predicted_bytes


@dataclass
class _Row:
    calls: int = 0
    nbytes: int = 0
    predicted: int = 0


@dataclass(eq=False)
class Traffic:
    """One buffer set's counters: since it was built, and in the current step."""

    # (kind, wire, dtype, ranks) -> totals; ranks: the collective's group size where recorded, else None
    rows: dict[tuple[str, str, str, int | None], _Row] = field(default_factory=dict)
    step_bytes: dict[str, int] = field(default_factory=dict)  # kind -> bytes this step
    step_predicted: dict[str, int] = field(default_factory=dict)
    warned: bool = False
    # What a mismatch means: blockshard's own engine planned and sent the bytes; another engine's
    # (FSDP2 under the adapter, DeepSpeed under the hook) is counted against the adapter's plan.
    cause: str = (
        "the engine sent other bytes than it planned (a bug in blockshard; please report it with "
        "blockshard.report(model) and blockshard.collective_counts(model))"
    )
    unsettled: dict[tuple[str, str, str], int] = field(default_factory=dict)  # bytes of calls checked per step

    def record(
        self,
        where: str,
        kind: int,
        nbytes: int,
        predicted: int | None,
        dtype: torch.dtype,
        wire: str,
        step: int,
        planned_wire: str | None = None,
        *,
        ranks: int | None = None,
    ) -> None:
        """Count one collective; ``planned_wire``: the wire format its plan gathers in (a quantized
        gather planned, floats sent: the plan predicts none of these bytes). ``predicted=None``:
        the plan predicts these calls together, not one by one (DeepSpeed's gradient buckets are
        its own choice; their sum is the plan's): :meth:`settle` checks them. ``ranks``: the size of
        the process group the call ran over (a row of its own per size)."""
        if planned_wire is not None and wire != planned_wire:
            predicted = 0
        name, dt = KINDS[kind], str(dtype).removeprefix("torch.")
        row = self.rows.setdefault((name, wire, dt, ranks), _Row())
        row.calls, row.nbytes = row.calls + 1, row.nbytes + nbytes
        self.step_bytes[name] = self.step_bytes.get(name, 0) + nbytes
        if predicted is None:
            self.unsettled[(name, wire, dt)] = self.unsettled.get((name, wire, dt), 0) + nbytes
        else:
            row.predicted += predicted
            self.step_predicted[name] = self.step_predicted.get(name, 0) + predicted
        steps = step_log_steps()
        if steps and step <= steps:
            logger.info(
                "step %d: %s of %s: %s bytes, %s, %s (plan: %s)",
                step,
                name,
                where,
                f"{nbytes:,}",
                dt,
                wire,
                "checked with the step's other calls" if predicted is None else f"{predicted:,}",
            )
        if predicted is not None and nbytes != predicted:
            self._mismatch(where, name, wire, dt, nbytes, predicted, planned_wire)

    def settle(self, where: str, kind: int, predicted: int, dtype: torch.dtype, wire: str = "float") -> None:
        """Check the calls recorded with ``predicted=None`` since the last settle against the plan's
        ``predicted`` bytes for all of them together, as calls of ``kind`` in ``dtype`` (one gradient
        reduction round of DeepSpeed: its buckets, cut where DeepSpeed chooses). Calls of another
        kind or dtype are a mismatch too: the plan predicts none of them."""
        name, dt = KINDS[kind], str(dtype).removeprefix("torch.")
        got = self.unsettled.pop((name, wire, dt), 0)
        row = self.rows.setdefault((name, wire, dt, None), _Row())
        row.predicted += predicted
        self.step_predicted[name] = self.step_predicted.get(name, 0) + predicted
        if got != predicted:
            self._mismatch(where, name, wire, dt, got, predicted, None)
        for (other, w, d), nbytes in list(self.unsettled.items()):
            self.unsettled.pop((other, w, d))
            self._mismatch(where, other, w, d, nbytes, 0, None)

    def _mismatch(
        self, where: str, kind: str, wire: str, dtype: str, nbytes: int, predicted: int, planned_wire: str | None
    ) -> None:
        plan = f"{predicted:,}" if planned_wire in (None, wire) else f"none as {wire} (it gathers {planned_wire})"
        text = f"the {kind} of {where} moved {nbytes:,} bytes ({dtype}, {wire}) where its plan predicts {plan}: {self.cause}"
        if strict():
            raise TrafficMismatchError(text + ". BLOCKSHARD_STRICT=0 lets the run go on")
        if not self.warned:
            self.warned = True
            warnings.warn(text, stacklevel=4)

    def take_step(self) -> tuple[dict[str, int], dict[str, int]]:
        """This step's bytes and predictions by kind, and a fresh step."""
        out = (self.step_bytes, self.step_predicted)
        self.step_bytes, self.step_predicted = {}, {}
        return out

    def counts(self, group: str, buffer_set: str) -> list[CollectiveCount]:
        return [
            CollectiveCount(group, buffer_set, kind, wire, dt, r.calls, r.nbytes, r.predicted, ranks)
            for (kind, wire, dt, ranks), r in self.rows.items()
        ]


_TAG = "_blockshard_traffic"


def tag_traffic(module: torch.nn.Module, name: str, traffic: Traffic) -> None:
    """Hang counters an adapter keeps for another engine's collectives on the module they count
    (an FSDP2 module of the adapter, the DeepSpeed hook's engine): :func:`collective_counts`
    reads them as it reads the engine's buffer sets ([Note: traffic])."""
    tags: list[tuple[str, Traffic]] = module.__dict__.setdefault(_TAG, [])
    tags.append((name, traffic))


def tagged_traffic(module: torch.nn.Module) -> list[tuple[str, Traffic]]:
    """The ``(name, counters)`` :func:`tag_traffic` hung on ``module`` (none: ``[]``)."""
    tags = module.__dict__.get(_TAG)
    return list(tags) if isinstance(tags, list) else []


@dataclass
class _StepLog:
    steps: int = 0  # log the first this many steps (0: off)
    read_env: bool = False
    on: bool = False  # BLOCKSHARD_LOG=info (or set_step_log(n > 0)): the engage lines and reports too


_state = _StepLog()


def set_step_log(steps: int | None = _DEFAULT_STEPS) -> None:
    """Log each collective of the first ``steps`` steps and one summary line per step to the
    ``blockshard`` logger at INFO ([Note: traffic]); ``0`` or ``None`` turns the log off. The
    environment's ``BLOCKSHARD_LOG=info`` does the same for ``BLOCKSHARD_LOG_STEPS`` steps (3)."""
    if steps is None:
        steps = 0
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise StepLogError(
            f"set_step_log(steps={steps!r}): steps must be an int >= 0 (the number of first steps to log; 0 turns "
            "the log off), e.g. set_step_log(3)"
        )
    step_log_steps()  # the environment's handler, if it asks for one
    _state.steps, _state.on = steps, steps > 0


def step_log_steps() -> int:
    """The number of first steps the step log covers (0: off); reads the environment once."""
    if not _state.read_env:
        _state.read_env = True
        _state.on = os.environ.get(LOG_ENV, "").strip().lower() in ("info", "debug", "1")
        _state.steps = _steps_from_env()
        if _state.on and not logging.getLogger("blockshard").handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("[blockshard %(rank)s] %(message)s"))
            handler.addFilter(_RankFilter())
            logger.addHandler(handler)
        if _state.on and logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
    return _state.steps


def log_on() -> bool:
    """Whether ``BLOCKSHARD_LOG=info`` (or :func:`set_step_log` with steps) asks for the log: the
    integrations' engage lines and their report at the end of ``prepare`` too. The environment
    is the launcher's, the same on every rank, so a collective behind it runs on every rank."""
    step_log_steps()
    return _state.on


def _steps_from_env() -> int:
    level = os.environ.get(LOG_ENV, "").strip().lower()
    if level in ("", "0", "off", "warning", "error"):
        return 0
    if level not in ("info", "debug", "1"):
        raise StepLogError(
            f"environment variable {LOG_ENV}={os.environ[LOG_ENV]!r} must be 'info' (log the first steps' collectives) "
            "or 'off' (the default), e.g. BLOCKSHARD_LOG=info"
        )
    raw = os.environ.get(STEPS_ENV, "").strip()
    if not raw:
        return _DEFAULT_STEPS
    if not raw.isdigit():
        raise StepLogError(
            f"environment variable {STEPS_ENV}={raw!r} must be a whole number of steps >= 0, e.g. {STEPS_ENV}=3"
        )
    return int(raw)


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = f"rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else "rank 0"
        return True


def log_step_summary(
    root: str, step: int, totals: dict[str, int], predicted: dict[str, int], *, subject: str | None = None
) -> None:
    """One line per root and step: bytes by kind against the plan's prediction (``subject``: what
    stepped, default "the model rooted at <root>")."""
    steps = step_log_steps()
    if not (steps and step <= steps):
        return
    parts = [
        f"{kind} {totals.get(kind, 0):,} bytes (plan {predicted.get(kind, 0):,})" for kind in KINDS if kind in totals
    ]
    agree = all(totals.get(k, 0) == predicted.get(k, 0) for k in KINDS)
    logger.info(
        "step %d of %s: %s: %s",
        step,
        subject or f"the model rooted at {root!r}",
        ", ".join(parts) or "no collective",
        "as planned" if agree else "NOT as planned",
    )
