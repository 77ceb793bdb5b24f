"""What an optimizer does with each sharded piece it holds, read without stepping it: its
param_group's hyperparameters, and the kind of state it keeps for the piece against the kind one
process keeps for the whole tensor.

[Note: state kind]
Quantizing optimizers choose the kind of state per tensor from the tensor they are given, so a
piece may get another kind than the whole tensor on one process:
  * bitsandbytes (``Optimizer8bit.init_state``): 32-bit state where ``optim_bits == 32`` (the
    optimizer's or a ``GlobalOptimManager`` override, read through its own ``get_config``) or where
    ``p.numel() < min_8bit_size`` (4096 by default), else 8-bit;
  * torchao (``_AdamBase._new_buffer``, ``AdamW8bit`` / ``AdamW4bit`` / ``AdamWFp8``): a quantized
    subclass where ``numel >= 4096`` and ``numel % block_size == 0``, else a plain fp32 tensor.
A piece that gets fp32 where one process keeps 8-bit state (or the reverse) steps otherwise than
one process, silently. :func:`state_kind` applies the optimizer's own rule to a number of elements;
the first-step check ([Note: first-step optimizer checks]) applies it to the piece and to the
global tensor. Other optimizers keep one kind whatever the size (``None``: nothing to compare).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from blockshard.runtime.core._param import managed_tag
from blockshard.semantics import blockwise_state_semantics

__all__ = ["HeldPiece", "held_pieces", "hyper_crc", "hyper_text", "state_kind"]

_SKIP = frozenset({"params", "param_names", "initial_lr"})  # not hyperparameters (initial_lr: a scheduler's copy)


def hyper_text(group: dict[str, Any]) -> str:
    """A param_group's hyperparameters as text (sorted, tensors as values): equal text, equal step."""
    parts = []
    for key in sorted(k for k in group if k not in _SKIP):
        value = group[key]
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        parts.append(f"{key}={value!r}")
    return ", ".join(parts)


def hyper_crc(text: str) -> int:
    return zlib.crc32(text.encode())


def state_kind(optimizer: torch.optim.Optimizer, gindex: int, pindex: int, numel: int) -> str | None:
    """[Note: state kind] ``"8-bit"`` / ``"4-bit"`` / ``"fp8"`` or ``"fp32"``: the state
    ``optimizer`` keeps for a tensor of ``numel`` elements at ``param_groups[gindex]['params'][pindex]``;
    ``None`` for an optimizer whose state kind does not depend on the size."""
    group = optimizer.param_groups[gindex]
    mod = type(optimizer).__module__
    if mod.startswith("bitsandbytes.") and hasattr(optimizer, "get_config") and hasattr(optimizer, "args"):
        config = optimizer.get_config(gindex, pindex, group)
        bits = int(config.get("optim_bits", 32))
        if bits == 32 or numel < int(config.get("min_8bit_size", 4096)):
            return "fp32"
        return f"{bits}-bit"
    if mod.startswith("torchao.") and hasattr(optimizer, "block_size") and hasattr(optimizer, "_subclass_zeros"):
        block = int(optimizer.block_size)
        if numel >= 4096 and numel % block == 0:
            name = type(optimizer).__name__
            return "4-bit" if "4bit" in name else "fp8" if "Fp8" in name else "8-bit"
        return "fp32"
    return None


def blockwise_semantics(optimizer: torch.optim.Optimizer) -> str | None:
    """The semantics of a blockwise 8-bit (4-bit) optimizer's state blocks (``"bnb8bit"``,
    ``"ao8bit"``, ``"ao4bit"``), as ``blockshard.optim.semantics_for_optimizer`` names them; None
    for any other optimizer (:func:`blockshard.semantics.blockwise_state_semantics` of its class)."""
    cls = type(optimizer)
    return blockwise_state_semantics(cls.__module__, cls.__name__)


@dataclass(frozen=True)
class HeldPiece:
    """One sharded piece an optimizer holds: where (``gindex``, ``pindex``), its ShardedParam
    (``sp``), its group (``buffers``), its hyperparameters' text and their CRC."""

    gindex: int
    pindex: int
    sp: Any  # ShardedParam
    buffers: Any  # ParamBuffers
    hyper: str
    hyper_crc: int

    @property
    def name(self) -> str:
        """The parameter's name under the root (its group's path and its name in the group)."""
        path = self.buffers.path
        return f"{path}.{self.sp.fqn}" if path else self.sp.fqn

    @property
    def global_numel(self) -> int:
        return math.prod(self.sp.entry_shape)  # a TP parameter's whole tensor, across tp

    def kinds(self, optimizer: torch.optim.Optimizer) -> tuple[str | None, str | None]:
        """The state kind for this rank's piece and for the whole tensor on one process."""
        return (
            state_kind(optimizer, self.gindex, self.pindex, self.sp.local_numel),
            state_kind(optimizer, self.gindex, self.pindex, self.global_numel),
        )


def held_pieces(optimizer: torch.optim.Optimizer) -> Iterator[HeldPiece]:
    """Every sharded piece ``optimizer`` holds (pieces of groups that are gone are left out)."""
    for gi, group in enumerate(optimizer.param_groups):
        text = hyper_text(group)
        crc = hyper_crc(text)
        for pi, p in enumerate(group["params"]):
            tag = managed_tag(p)
            if tag is None or tag.original or tag.group is None:
                continue
            buffers = tag.group()  # type: ignore[operator]  # a weakref.ref to the ParamBuffers
            if buffers is None:
                continue
            for sp in buffers.params:
                if sp.sharded is p:
                    yield HeldPiece(gi, pi, sp, buffers, text, crc)
                    break
