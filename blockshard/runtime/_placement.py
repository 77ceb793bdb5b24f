"""FSDP2's ``shard_placement_fn`` under blockshard: checked as FSDP2 checks it, then not needed.

[Note: shard placements]
FSDP2 (torch 2.13, ``_fsdp_param.py``, ``_init_sharded_param``) calls ``shard_placement_fn(param)``
for every parameter of the group and shards the parameter by the ``Shard(dim)`` it returns (None:
``Shard(0)``; a negative dim counts from the end). Which elements a rank stores changes nothing a
training step computes (gathers rebuild the whole tensor, element-wise optimizers step every
element as one process does), so FSDP2 code passes it to choose a storage cut, e.g. ``Shard(1)``
for stacked experts when there are fewer experts than ranks. blockshard's cut is chosen by
``semantics`` (whole units of each tensor's block semantics, ragged across ranks), which already
avoids the padding ``Shard(dim)`` is picked to avoid; so ``fully_shard`` accepts the function, calls
it as FSDP2 does, refuses what FSDP2 refuses (a dim out of range, a result that is not a ``Shard``),
and lays the group out by ``semantics`` alone. What blockshard cannot do is a placement on a mesh of
its own per parameter (FSDP2's ``ShardPlacementResult``): that raises, naming the fix.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from blockshard._errors import ShardingError

__all__ = ["check_shard_placements"]


def check_shard_placements(fn: Callable[[nn.Parameter], object], names: list[str], params: list[nn.Parameter]) -> None:
    """Call ``fn`` on every parameter of the group and check each result as FSDP2 does."""
    from torch.distributed.tensor import Shard

    if not callable(fn):
        raise ShardingError(f"shard_placement_fn={fn!r} must be None or a callable (param) -> Shard | None")
    for name, p in zip(names, params, strict=True):
        placement = fn(p)
        if placement is None:
            continue
        if not isinstance(placement, Shard):
            raise ShardingError(
                f"shard_placement_fn returned {placement!r} for parameter {name!r} (shape {tuple(p.shape)}); "
                "blockshard takes Shard(dim) or None (FSDP2's per-parameter meshes, ShardPlacementResult, are "
                "not supported: every parameter of a group shards over the group's mesh). Fix: return "
                "Shard(dim) or None, or shard such parameters in a fully_shard call of their own with mesh="
            )
        dim = placement.dim + p.ndim if placement.dim < 0 else placement.dim
        if not 0 <= dim < max(p.ndim, 1):
            raise ShardingError(
                f"shard_placement_fn returned Shard({placement.dim}) for parameter {name!r} of shape "
                f"{tuple(p.shape)}: Shard dim {dim} is invalid for a {p.ndim}D tensor. Fix: return a dim in "
                f"[-{p.ndim}, {p.ndim}) or None (Shard(0)), e.g. by checking param.ndim"
            )
