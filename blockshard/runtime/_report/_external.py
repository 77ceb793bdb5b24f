"""What other engines tell the report: notes on FSDP2 DTensor parameters and ZeRO partitions.

The runtime may not import the integrations (docs/design.md, "Layers"), so the integrations hand
the report what they decided through the types here: the FSDP2 adapter tags each DTensor
parameter it placed with a :class:`PlacementNote` (as the engine tags its own pieces), and the
DeepSpeed hook's ZeRO optimizer is a :class:`PartitionSource`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from blockshard.planner import OrderedLayout

__all__ = ["ComputeTensors", "PartitionGroup", "PartitionSource", "PlacementNote", "placement_note", "tag_placement"]

_NOTE_ATTR = "_blockshard_placement_note"


@dataclass(frozen=True)
class PlacementNote:
    """How an adapter placed one parameter on another engine (FSDP2's ``Shard(dim)``)."""

    semantics: str
    placement_unit_numel: int
    compute_unit_numel: int
    owner_compute: bool  # the optimizer reassembles cut compute units at owners
    reason: str


def tag_placement(param: torch.Tensor, note: PlacementNote) -> None:
    setattr(param, _NOTE_ATTR, note)


def placement_note(param: torch.Tensor) -> PlacementNote | None:
    note = getattr(param, _NOTE_ATTR, None)
    return note if isinstance(note, PlacementNote) else None


@dataclass(frozen=True)
class PartitionGroup:
    """One ZeRO ``param_group`` partitioned by an ordered layout: rank ``r`` holds
    ``[r * S, (r + 1) * S)`` of the flat buffer (``partition`` on this rank: the master copy)."""

    layout: OrderedLayout
    names: tuple[str, ...]  # the engine's names of the parameters, in layout order
    params: tuple[torch.Tensor, ...]  # the parameters themselves (whole on every rank), in layout order
    semantics: tuple[str, ...]
    unit_numels: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    partition: torch.Tensor  # this rank's flat partition (fp32 masters)
    process_group: dist.ProcessGroup
    views: Sequence[tuple[int, torch.Tensor]]  # (index in the layout, the tensor the inner optimizer steps)


@runtime_checkable
class PartitionSource(Protocol):
    """An engine's optimizer that partitions its parameters (the DeepSpeed hook's ZeRO optimizer)."""

    def blockshard_partitions(self) -> list[PartitionGroup]: ...

    def blockshard_engine(self) -> str: ...  # e.g. "DeepSpeed ZeRO-2"

    def blockshard_inner_optimizer(self) -> torch.optim.Optimizer: ...


@runtime_checkable
class ComputeTensors(Protocol):
    """An optimizer that steps other tensors than the model's parameters (blockshard.optim's
    owner-compute optimizers: pieces, whole units at their owners)."""

    def blockshard_compute_tensors(
        self,
    ) -> tuple[torch.optim.Optimizer, list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """``(inner optimizer, the model parameters it steps, [(compute tensor, its parameter)])``."""
        ...
