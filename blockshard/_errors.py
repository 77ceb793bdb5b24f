"""Errors raised for bad user input.

Every user-facing error is a ``ValueError`` subclass whose message names the offending
parameter or tensor, the value, the constraint that failed and how to fix it. Two are
``RuntimeError`` subclasses, because no input of one rank caused them: ``CollectiveIntegrityError``
(the ranks' collectives did not line up, or a peer failed) and ``EngineStateError`` (a bug).
Internal invariants use ``assert``. Every layer imports its errors from here (the engine's are
re-exported by ``blockshard.runtime``, where users import them).
"""

from __future__ import annotations

__all__ = [
    "BlockshardError",
    "CheckpointError",
    "ClipError",
    "CollectiveIntegrityError",
    "ComputeUnitError",
    "EngineStateError",
    "LayoutMismatchError",
    "OptimizerSetupError",
    "PieceTensorError",
    "PlanError",
    "QuantizedWeightError",
    "ReportError",
    "SemanticsError",
    "ShapesError",
    "ShardingError",
    "TorchRouteError",
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
    """A quantized weight cannot be sharded by whole quantization blocks (blocks that do not divide its
    shape, nested statistics that do not fit its blocks, a quant state that contradicts its parameter)."""


class CheckpointError(BlockshardError):
    """A checkpoint that is incomplete or does not fit the model it is loaded into, or a path or file
    system a checkpoint cannot be written to."""


class ShardingError(BlockshardError):
    """``fully_shard`` was used in a way the engine does not support (with the fix in the message)."""


class OptimizerSetupError(ShardingError):
    """An optimizer over sharded pieces would step them otherwise than one process would
    ([Note: first-step optimizer checks] in runtime/core/_optim_checks.py); raised on every rank."""


class EngineStateError(RuntimeError):
    """An impossible transition of the engine's state machines (a bug: please report it)."""


class ClipError(BlockshardError):
    """``clip_grad_norm_`` was given something it cannot clip (with the fix in the message)."""


class CollectiveIntegrityError(RuntimeError):
    """The ranks' collectives did not line up (or a peer failed): named group, phase and fix."""


class LayoutMismatchError(BlockshardError):
    """Ranks computed different layouts for the same group (different models, semantics or W)."""


class PieceTensorError(BlockshardError):
    """An operation that needs the whole tensor was applied to one rank's piece of it."""


class TorchRouteError(BlockshardError):
    """A torch function blockshard routes ([Note: torch routes]) differs on the installed torch from
    what the route was written for, or ``BLOCKSHARD_TORCH_ROUTES`` names no route."""


class ReportError(BlockshardError):
    """A run report that cannot be built or read (a bad file, a model sharded over mixed process groups)."""
