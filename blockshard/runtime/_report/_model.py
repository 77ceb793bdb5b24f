"""The rows of :class:`Report`: what was sharded, replicated and stepped (pure data, JSON round trip).

[Note: run report]
``blockshard.report(model, optimizers=...)`` answers "what did sharding really do" from what the
engines hold, never from what a plan says they should hold. Every per-rank figure is this rank's
own measurement (the length of a buffer, the bytes of a state tensor), gathered from every rank of
the process group the model is sharded over. Sizes are ``_bytes``; every ratio says what it
divides by in its name (``held_over_ideal``: bytes held over ``total / W``, the unpadded physical
bytes divided evenly). A figure an engine does not expose is ``None`` and rendered as "unknown"
with the reason in the row's ``note``, never a guess.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from blockshard._errors import ReportError
from blockshard.runtime._report._show import plot, render

__all__ = ["REPORT_FORMAT_VERSION", "GroupRow", "OptimizerRow", "ParamRow", "Report", "StateRow"]

REPORT_FORMAT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class ParamRow:
    """One parameter: how it is sharded (or why it is replicated) and the bytes each rank holds of it."""

    name: str  # as model.named_parameters() gives it
    group: str  # the group's name ("" when replicated)
    shape: tuple[int, ...]  # the global shape
    dtype: str
    sharded: bool
    how: str  # "blockshard ragged", "FSDP2 Shard(0)", "DeepSpeed ZeRO-2 partition", "replicated"
    semantics: str | None = None
    placement_unit_numel: int | None = None
    compute_unit_numel: int | None = None
    policy: str | None = None  # "whole" | "owner" (blockshard), None where not applicable
    owner_ranks: tuple[int, ...] = ()  # owner-computed: the ranks that compute its cut units
    held_bytes: tuple[int, ...] = ()  # per rank: real bytes of it (no padding)
    padding_bytes: int | None = None  # the padding the placement adds after it (None: unknown)
    note: str = ""  # replicated: why; else anything the engine could not tell

    @property
    def total_bytes(self) -> int:
        return sum(self.held_bytes) if self.sharded else (self.held_bytes[0] if self.held_bytes else 0)


@dataclass(frozen=True, kw_only=True)
class GroupRow:
    """One group (a ``fully_shard`` group's buffer set, an FSDP2 group, a ZeRO partition)."""

    name: str
    how: str
    dtype: str
    world_size: int
    num_params: int
    total_bytes: int  # unpadded: the bytes of its tensors
    held_bytes: tuple[int, ...]  # per rank: what its buffer takes (padding included)
    data_bytes: tuple[int, ...]  # per rank: real bytes (no padding)
    padding_bytes: int  # W * segment - total (FSDP2: each parameter's Shard(dim) rounding)
    note: str = ""

    @property
    def padding_fraction(self) -> float:
        """Padding over the padded buffer (``W * S``), as the planner's ``padding_fraction``."""
        padded = self.total_bytes + self.padding_bytes
        return self.padding_bytes / padded if padded else 0.0

    @property
    def held_max_over_ideal(self) -> float:
        """The largest rank's held bytes over ``total / W`` (unpadded, split evenly): 1.0 is perfect."""
        ideal = self.total_bytes / self.world_size
        return max(self.held_bytes, default=0) / ideal if ideal else 1.0


@dataclass(frozen=True, kw_only=True)
class StateRow:
    """One state tensor kind of one parameter in one optimizer, summed over ranks per rank."""

    param: str
    key: str  # "exp_avg", "state1", "momentum_buffer", ...
    dtype: str
    bytes: tuple[int, ...]  # per rank
    kind: str  # "8-bit" / "fp32" / ... (from the state's dtype)
    as_one_process: bool | None = None  # the same kind as one process would keep (None: not checked)
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class OptimizerRow:
    index: int
    name: str  # the optimizer's class
    steps: tuple[str, ...]  # parameter names it steps (on any rank)
    states: tuple[StateRow, ...]
    note: str = ""

    @property
    def state_bytes(self) -> tuple[int, ...]:
        """Bytes of its state tensors per rank."""
        if not self.states:
            return ()
        return tuple(sum(s.bytes[r] for s in self.states) for r in range(len(self.states[0].bytes)))


@dataclass(frozen=True, kw_only=True)
class Report:
    """What was sharded and how, what is replicated and why, and what the optimizers step ([Note: run report])."""

    world_size: int
    engine: str  # "blockshard", "fsdp2", "deepspeed", "none" (or several, joined by "+")
    groups: tuple[GroupRow, ...] = ()
    params: tuple[ParamRow, ...] = ()
    optimizers: tuple[OptimizerRow, ...] = ()
    not_stepped: tuple[str, ...] = ()  # trainable parameters no optimizer in ``optimizers`` steps
    optimizers_given: bool = False  # whether ``optimizers`` was passed (else not_stepped is not known)
    notes: tuple[str, ...] = ()
    version: int = field(default=REPORT_FORMAT_VERSION)

    # -- totals -----------------------------------------------------------------------------------
    @property
    def replicated(self) -> tuple[ParamRow, ...]:
        return tuple(p for p in self.params if not p.sharded)

    @property
    def total_bytes(self) -> int:
        """Unpadded physical bytes of every row (each parameter once, sharded or replicated; a ZeRO
        partition's fp32 masters beside the whole parameters)."""
        return sum(p.total_bytes for p in self.params)

    @property
    def held_bytes(self) -> tuple[int, ...]:
        """Per rank: the groups' buffers (padding included) and every replicated parameter whole."""
        rep = sum(p.total_bytes for p in self.replicated)
        return tuple(sum(g.held_bytes[r] for g in self.groups) + rep for r in range(self.world_size))

    @property
    def held_max_over_ideal(self) -> float:
        """The largest rank's held bytes over ``total_bytes / W`` (unpadded, split evenly)."""
        ideal = self.total_bytes / self.world_size
        return max(self.held_bytes, default=0) / ideal if ideal else 1.0

    # -- output -----------------------------------------------------------------------------------
    def render(self, console: Any = None) -> None:
        """Print the tables (rich) on ``console`` (default: stdout)."""
        render(self, console)

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Write the bytes held per rank against ``total / W`` to ``path`` (matplotlib)."""
        plot(self, path)

    # -- JSON -------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["format"] = data.pop("version")
        data["totals"] = {  # derived figures, for readers of the file (from_json recomputes them)
            "total_bytes": self.total_bytes,
            "held_bytes": list(self.held_bytes),
            "held_max_over_ideal": self.held_max_over_ideal,
        }
        out: dict[str, Any] = json.loads(json.dumps(data))  # tuples as lists: what json.load gives back
        return out

    @classmethod
    def from_json(cls, data: object) -> Report:
        if not isinstance(data, dict) or data.get("format") != REPORT_FORMAT_VERSION:
            got = data.get("format") if isinstance(data, dict) else f"a {type(data).__name__}"
            raise ReportError(
                f"report JSON has format={got!r}, not {REPORT_FORMAT_VERSION}; pass a file written by "
                "blockshard.report(...).to_json() (json.dump) or `blockshard report --json`"
            )
        try:
            return cls(
                world_size=int(data["world_size"]),
                engine=str(data["engine"]),
                groups=tuple(_row(GroupRow, g) for g in data["groups"]),
                params=tuple(_row(ParamRow, p) for p in data["params"]),
                optimizers=tuple(_optimizer(o) for o in data["optimizers"]),
                not_stepped=tuple(data["not_stepped"]),
                optimizers_given=bool(data["optimizers_given"]),
                notes=tuple(data["notes"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ReportError(
                f"report JSON is malformed ({type(e).__name__}: {e}); pass a file written by "
                "blockshard.report(...).to_json() with this version of blockshard"
            ) from None


def _row(cls: type[Any], data: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    extra = set(data) - names
    if extra:
        raise ValueError(f"unknown keys {sorted(extra)} in a {cls.__name__}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def _optimizer(data: dict[str, Any]) -> OptimizerRow:
    states = tuple(_row(StateRow, s) for s in data["states"])
    out: OptimizerRow = _row(OptimizerRow, {**data, "states": states})
    return out
