"""The collectives the engine issues, in one place.

Phase by phase (one group, bucket ``b`` with segment ``S_b``; ``W`` ranks):
  * **all-gather** (unshard): every rank sends its ``S_b`` local elements (cast to the parameter
    dtype) and receives ``W * S_b`` into the bucket's slice of the gathered buffer, whose views
    *are* the unsharded parameters: no copy-out.
  * **reduce-scatter** (gradient sync): every rank sends the bucket's ``W * S_b`` slice of the
    gathered gradient buffer and receives the average of its own ``S_b`` segment over ranks.
  * **layout check** (once per ``fully_shard``): an all-gather of a small object so a rank whose
    layout differs raises before any tensor collective could hang on mismatched sizes.
  * **end-of-step check** (once per backward, in the final callback): see below.

[Note: collective integrity]
Collectives that do not line up across ranks (a rank skips a step, runs an extra forward, leaves
a module unused, or has other requires_grad flags) either hang or pair the wrong buffers. Two
guards make every such case an error on every rank, in bounded time, at next to no cost:
  1. every engine collective is waited for at most ``BLOCKSHARD_COLLECTIVE_TIMEOUT_S`` seconds
     (default 30), and a timeout or a failed peer raises :class:`CollectiveIntegrityError`
     naming the group and the phase (gloo's own default timeout is 30 minutes);
  2. each rank's root context counts the collectives it issues in a step (a count and an
     order-sensitive hash of (group, kind)) and hashes the requires_grad flags; at the end of
     backward one all-reduce (MAX of the four int64 and of their negatives: every field's max
     and min) compares them and the step number, so collectives that paired silently raise before
     ``optimizer.step()`` can use the gradients (only then an all-gather collects the details).
The cost is one 64-byte all-reduce per step, whatever the number of groups.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from blockshard._errors import BlockshardError

__all__ = [
    "TIMEOUT_ENV",
    "CollectiveIntegrityError",
    "LayoutMismatchError",
    "all_gather_into",
    "check_same_layout",
    "collective_timeout_s",
    "reduce_scatter_avg",
    "shift_ranks",
    "wait",
]

#: Seconds an engine collective may wait for its peers before every waiting rank raises.
TIMEOUT_ENV = "BLOCKSHARD_COLLECTIVE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 30.0

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveIntegrityError(RuntimeError):
    """The ranks' collectives did not line up (or a peer failed): named group, phase and fix."""


def collective_timeout_s() -> float:
    """[Note: collective integrity] The bound on one engine collective's wait, in seconds."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise BlockshardError(f"environment variable {TIMEOUT_ENV}={raw!r} must be a number of seconds > 0, e.g. 30")
    return value


def wait(work: dist.Work, what: str, group: dist.ProcessGroup) -> None:
    """Wait for ``work`` at most :func:`collective_timeout_s`; a timeout or a failed peer raises
    :class:`CollectiveIntegrityError` naming ``what`` (the group and the phase)."""
    timeout = collective_timeout_s()
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CollectiveIntegrityError(
            f"blockshard: {what} on rank {group.rank()} of {group.size()} did not complete ({first}; waited at most "
            f"{timeout:g} s, {TIMEOUT_ENV}). A peer rank failed or exited, or the ranks' collectives do not line up: "
            "every rank must run the same forward and backward passes, over the same modules, with the same "
            "requires_grad flags, in every step. See the other ranks' errors for the first failure"
        ) from e


class LayoutMismatchError(BlockshardError):
    """Ranks computed different layouts for the same group (different models, semantics or W)."""


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False):
    assert out.numel() == inp.numel() * group.size() and out.dtype == inp.dtype, (out.shape, inp.shape)
    return _all_gather(out, inp, group=group, async_op=async_op)


def reduce_scatter_avg(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False):
    assert inp.numel() == out.numel() * group.size() and out.dtype == inp.dtype, (out.shape, inp.shape)
    return _reduce_scatter(out, inp, op=dist.ReduceOp.AVG, group=group, async_op=async_op)


def check_same_layout(group_name: str, layout_hash: str, group: dist.ProcessGroup) -> None:
    """Raise :class:`LayoutMismatchError` on every rank unless all ranks computed ``layout_hash``."""
    mine = (group_name, layout_hash)
    everyone: list = [None] * group.size()
    dist.all_gather_object(everyone, mine, group=group)
    if len(set(everyone)) > 1:
        by_rank = ", ".join(f"rank {r}: group {n!r} hash {h}" for r, (n, h) in enumerate(everyone))
        raise LayoutMismatchError(
            f"fully_shard: ranks disagree on the layout of group {group_name!r} ({by_rank}). Every rank "
            "must shard the same model with the same semantics, alignment and world size, in the same "
            "order (bottom-up, identical fully_shard calls)"
        )


def shift_ranks(local: torch.Tensor, k: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Rank ``r``'s ``local`` moves to rank ``(r + k) % W``: returns what this rank receives.

    One ``all_to_all_single`` with a single non-empty split each way (a layout rotation, once,
    before training).
    """
    W, r, n = group.size(), group.rank(), local.numel()
    send, recv = [0] * W, [0] * W
    send[(r + k) % W], recv[(r - k) % W] = n, n
    out = torch.empty_like(local)
    dist.all_to_all_single(out, local, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out
