"""Arithmetic the planner, the integrations, the CLI and the launcher share (pure: no process group).

Where things live: the integer helpers that ``semantics`` needs as well (``ceil_div``,
``round_up``, the rows view ``rows_cols`` and ``block_shape``) are in :mod:`blockshard._arith`, the
bottom layer, because ``semantics`` must not import ``planner`` (dependencies point down). This
module re-exports them and adds what only the layers from ``planner`` up need:

* :func:`check_world_size`: the one validator of a world size, raising :class:`WorldSizeError`
  with one message (parameter, value, constraint, fix) wherever a number of ranks is passed;
* :func:`check_alignment_bytes`: the one validator of a segment alignment (a power of two of
  bytes, at most ``MAX_ALIGNMENT_BYTES``), for the planner, the CLI, the engine and the adapters;
  :func:`check_alignment_numel` the same bound for the packer's alignment in elements;
* :func:`rank_overlap`: how many elements of each span every rank holds when rank ``r`` owns
  ``[r * S, (r + 1) * S)``, accumulated with a difference array in ``O(spans + W)``;
* :func:`layout_hash`: the stable hash of a layout's JSON that every rank must agree on;
* :data:`Memo`: the planning memo that identical groups of one model share.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Sequence
from typing import Any, TypeAlias

import numpy as np

from blockshard._arith import block_shape, ceil_div, round_up, rows_cols
from blockshard._errors import BlockshardError, PlanError, WorldSizeError
from blockshard._limits import MAX_ALIGNMENT_BYTES, MAX_MODEL_TENSORS, MAX_WORLD_SIZE, big_number

__all__ = [
    "Memo",
    "block_shape",
    "ceil_div",
    "check_alignment_bytes",
    "check_alignment_numel",
    "check_model_tensors",
    "check_world_size",
    "layout_hash",
    "rank_overlap",
    "round_up",
    "rows_cols",
]

#: One plan's memo, shared by its groups: each key is a tuple of a computation's inputs, most led by a
#: tag naming it (``("straddle", grid, offset, S)``); the value is that computation's result, which
#: its one reader annotates (the values differ in type, so the mapping holds ``Any``).
Memo: TypeAlias = dict[tuple[Hashable, ...], Any]


def check_world_size(value: object, name: str = "world_size") -> int:
    """``value`` as an ``int`` if it is an integer in ``[1, MAX_WORLD_SIZE]`` (a number of ranks), else
    :class:`WorldSizeError`.

    ``name`` is how the caller's user spells the parameter (``"world_size"``, ``"--world-size"``).
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise WorldSizeError(
            f"{name}={value!r} must be an integer >= 1 (a number of ranks); pass a positive int, e.g. {name}=8"
        )
    if value > MAX_WORLD_SIZE:
        raise WorldSizeError(
            f"{name}={value!r} is more than {MAX_WORLD_SIZE:,} (2**20), the most ranks blockshard plans "
            f"(the planner builds per-rank arrays); pass a world size <= {MAX_WORLD_SIZE}"
        )
    return int(value)


def check_alignment_bytes(
    value: object, name: str = "alignment_bytes", error: type[BlockshardError] = PlanError
) -> int:
    """``value`` as an ``int`` if it is a power of two (a number of bytes) of at most
    ``MAX_ALIGNMENT_BYTES``, else ``error``.

    Segments are aligned for vectorized kernels and collectives, whose alignments are powers of
    two; 3 or 12 bytes is a typo, and so is more than a page (see :mod:`blockshard._limits`).
    ``name`` is how the caller's user spells the parameter.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or value < 1
        or int(value) & (int(value) - 1)
    ):
        raise error(
            f"{name}={value!r} must be a positive integer power of two (a number of bytes: 1, 2, 4, 8, 16, ... "
            f"up to {MAX_ALIGNMENT_BYTES}); pass e.g. {name}=16"
        )
    if value > MAX_ALIGNMENT_BYTES:
        raise error(
            f"{name}={_shown(int(value))} is more than {MAX_ALIGNMENT_BYTES} bytes (a page), the largest "
            "segment alignment blockshard accepts: every group pads its per-rank segments to a multiple of it "
            f"(kernels and collectives need 16 to 512 bytes); pass e.g. {name}=16"
        )
    return int(value)


def _shown(n: int) -> str:
    return str(n) if n < 10**30 else big_number(n)


def check_alignment_numel(value: object, name: str = "alignment_numel") -> int:
    """``value`` as an ``int`` if it is an integer in ``[1, MAX_ALIGNMENT_BYTES]`` (an alignment in
    elements: at most the elements of a ``MAX_ALIGNMENT_BYTES`` alignment of 1-byte elements), else
    :class:`PlanError`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise PlanError(f"{name}={value!r} must be an integer >= 1 (elements); pass e.g. {name}=1")
    if value > MAX_ALIGNMENT_BYTES:
        raise PlanError(
            f"{name}={_shown(int(value))} is more than {MAX_ALIGNMENT_BYTES} elements (the most a "
            f"{MAX_ALIGNMENT_BYTES}-byte alignment gives, of 1-byte elements); pass e.g. {name}=1, or "
            "alignment_bytes to plan_group / plan_model"
        )
    return int(value)


def check_model_tensors(count: int, what: str) -> None:
    """Raise :class:`PlanError` if ``what`` (a model, a file) has more than ``MAX_MODEL_TENSORS`` tensors."""
    if count > MAX_MODEL_TENSORS:
        raise PlanError(
            f"{what} has {count:,} tensors, more than the {MAX_MODEL_TENSORS:,} blockshard plans at "
            "once (about a minute); plan a part of the model (some layers) at a time"
        )


def rank_overlap(
    starts: Sequence[int] | np.ndarray,
    ends: Sequence[int] | np.ndarray,
    segment_numel: int | Sequence[int] | np.ndarray,
    world_size: int,
) -> np.ndarray:
    """Elements of the spans ``[starts[i], ends[i])`` that each rank holds (int64, length ``world_size``).

    Rank ``r`` holds ``[r * s_i, (r + 1) * s_i)`` of span ``i``'s coordinate space, ``s_i`` being
    ``segment_numel`` (one size for all spans, or one per span). The two end pieces of a span are
    added directly and the whole segments between them through a difference array, so the cost is
    ``O(spans + W)`` whatever the spans' lengths. Empty spans add nothing; every span must lie in
    ``[0, world_size * s_i)``.
    """
    a = np.asarray(starts, dtype=np.int64)
    b = np.asarray(ends, dtype=np.int64)
    s = np.broadcast_to(np.asarray(segment_numel, dtype=np.int64), a.shape)
    keep = b > a
    a, b, s = a[keep], b[keep], s[keep]
    ra, rb = a // s, (b - 1) // s
    n = world_size + 1
    # np.bincount sums in float64: exact for the element counts here (below 2**53)
    out = np.bincount(ra, weights=np.minimum(b, (ra + 1) * s) - a, minlength=n)  # first piece
    multi = rb > ra
    rbm, sm = rb[multi], s[multi]
    out += np.bincount(rbm, weights=b[multi] - rbm * sm, minlength=n)  # last piece
    diff = np.bincount(ra[multi] + 1, weights=sm, minlength=n)  # whole segments in between
    diff -= np.bincount(rbm, weights=sm, minlength=n)
    return np.rint(out + np.cumsum(diff))[:world_size].astype(np.int64)


def layout_hash(data: object) -> str:
    """A stable 16-hex-digit hash of a JSON-serializable layout description.

    Canonical JSON (sorted keys, no spaces) hashed with SHA-256: every rank that computed the same
    layout gets the same string, on any machine and Python version.
    """
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
