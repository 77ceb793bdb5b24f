"""Errors raised for bad user input.

Every user-facing error is a ``ValueError`` subclass whose message names the offending
parameter or tensor, the value, the constraint that failed and how to fix it.
Internal invariants use ``assert``.
"""

from __future__ import annotations

__all__ = [
    "BlockshardError",
    "CheckpointError",
    "ComputeUnitError",
    "PlanError",
    "QuantizedWeightError",
    "SemanticsError",
    "ShapesError",
    "WorldSizeError",
]


class BlockshardError(ValueError):
    """Base class of blockshard's errors about user input."""


class SemanticsError(BlockshardError):
    """A block semantics cannot be applied (unknown name, shape not divisible into units, conflict)."""


class ComputeUnitError(SemanticsError):
    """Two semantics on one tensor ask for compute units that do not nest (neither holds whole units of the other)."""


class PlanError(BlockshardError):
    """The planner was given input it cannot lay out (bad world size, empty group, mixed dtypes)."""


class ShapesError(BlockshardError):
    """A model description (catalog name, config.json, tensor list) is malformed or unknown."""


class WorldSizeError(PlanError):
    """A world size (number of ranks) that is not a positive integer, wherever it is passed."""


class QuantizedWeightError(SemanticsError):
    """A quantized weight cannot be sharded by whole quantization groups (groups that do not divide its
    shape, nested statistics that do not fit its blocks, a quant state that contradicts its parameter)."""


class CheckpointError(BlockshardError):
    """A checkpoint that is incomplete or does not fit the model it is loaded into, or a path or file
    system a checkpoint cannot be written to."""
