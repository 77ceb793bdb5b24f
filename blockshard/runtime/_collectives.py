"""The collectives the engine issues, in one place.

Phase by phase (one group, bucket ``b`` with segment ``S_b``; ``W`` ranks):
  * **all-gather** (unshard): every rank sends its ``S_b`` local elements (cast to the parameter
    dtype) and receives ``W * S_b`` into the bucket's slice of the gathered buffer, whose views
    *are* the unsharded parameters: no copy-out.
  * **reduce-scatter** (gradient sync): every rank sends the bucket's ``W * S_b`` slice of the
    gathered gradient buffer and receives the average of its own ``S_b`` segment over ranks.
  * **layout check** (once per ``fully_shard``): an all-gather of a small object so a rank whose
    layout differs raises before any tensor collective could hang on mismatched sizes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from blockshard._errors import BlockshardError

__all__ = ["LayoutMismatchError", "all_gather_into", "check_same_layout", "reduce_scatter_avg", "shift_ranks"]

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
