"""FSDP2's int ``reshard_after_forward``: between forward and backward, parameters sharded over a
smaller world of ``k`` ranks, so backward's all-gather runs within those ``k``.

[Note: reshard to a smaller world]
FSDP2 (torch 2.13: ``_get_post_forward_mesh_info`` in ``_fsdp_init.py``, ``to_sharded_post_forward``
in ``_fsdp_param.py``, ``_all_gather_process_group`` in ``_fsdp_param_group.py``) reads
``reshard_after_forward=k``, a factor of the shard group's size ``W`` with ``1 < k < W``, as: after
forward, keep each parameter sharded over ``k`` ranks (``W / k`` times a shard's memory); backward
all-gathers it within those ``k`` ranks (e.g. one node's, over the fast links); after backward
the parameters go back to the ``W``-sharding. FSDP2's ``k``-groups are the rows of the shard mesh
viewed as ``(-1, k)``: consecutive ranks ``[g * k, (g + 1) * k)`` of the shard group, member ``j =
rank % k`` keeping chunk ``j`` of ``k``. blockshard groups the ranks the same way, by their rank in
the shard group (under HSDP each replica's shard group is cut alike; FSDP2 flattens the mesh to the
same rows).

On the ragged engine bucket ``b``'s gathered buffer ``[W * S_b]`` is the concatenation over ranks
``q`` of their segments. Member ``j`` of a ``k``-group keeps the *run* of segments ``j * W / k`` to
``(j + 1) * W / k - 1`` (``[W / k * S_b]``, contiguous there): the ``k``-group's
``all_gather_into_tensor`` of the members' runs, in member order, *is* the gathered bucket, so
backward refills the gathered buffer in place, with no copy at the gather; the unsharded
parameters stay the same views of it (autograd's saved references too). Keeping the run costs one
copy after forward into a buffer ``[W / k * S]`` of the param dtype (FSDP2 clones its chunk too), and
the gathered storage is freed as under ``True``. Per buffer set:

  * post-forward, where a backward follows: copy the run, free the gathered storage, give the
    modules their ``W``-sharded pieces back (SHARDED, as under ``True``; FSDP2 registers its
    ``k``-sharded DTensors instead). A forward that no backward follows (``torch.no_grad()``)
    reshards fully and keeps nothing.
  * an all-gather issued *in backward* (pre-backward, a prefetch, an activation-checkpoint
    recompute) while a run is kept: one ``all_gather_into_tensor`` per bucket over the ``k``-group
    (counted as the group's all-gather in the tally and the traffic, with ``ranks=k``: [Note:
    traffic]; its header, [Note: collective headers], is checked on the whole shard group), and
    the run is dropped once the gather is waited for.
  * any other all-gather (the next forward; a second call of the module in the same forward, where
    FSDP2 would gather over ``k``) drops the run and gathers over ``W`` from the local shard, as do
    ``reshard()``, the end of backward and an interrupted step: a run is never read once the
    shards may have changed (an optimizer step, a checkpoint load). Every rank runs the same
    program, so every rank takes the same branch.
Memory between forward and backward is ``W / k * S`` per buffer set instead of ``S``
(``tests/runtime/test_reshard_smaller_world.py`` measures it). The local shard is not read by the
backward's gather: an in-place change to the sharded parameters between forward and backward is
seen by backward only after ``module.reshard()``, as FSDP2's documentation says for an int.

Mixed precision (the run is in ``param_dtype``, what the gather moves), CPU offload (the run is on
the device, beside the gathered buffer), HSDP (the replicate all-reduce is untouched) and each
dtype's buffer set of a group ([Note: mixed dtypes]) use it alike. Quantized gathers and frozen
quantized weights gather bytes of their own: ``fully_shard`` refuses an int for their groups
(``check_post_forward`` in runtime/_arguments.py) rather than reshard them another way.

The ``k``-groups are process groups made once per (shard group, ``k``) at the first ``fully_shard``
that asks for them: every rank of the shard group calls ``new_group`` for every ``k``-group, in the
same order (``use_local_synchronization=True``: a rank makes only its own, as the engine groups,
and non-members return at once), with the engine's timeout on gloo ([Note: collective integrity]).
"""

from __future__ import annotations

import datetime
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from blockshard.planner import GroupLayout
from blockshard.runtime.core._collectives import collective_timeout_s

__all__ = ["PostForwardGroup", "keep_run", "post_forward_group"]


@dataclass(frozen=True, eq=False)
class PostForwardGroup:
    """This rank's ``k``-group of an int ``reshard_after_forward`` ([Note: reshard to a smaller world])."""

    size: int  # k
    group: dist.ProcessGroup  # the k ranks this rank belongs to
    member: int  # this rank's position j among them: its rank in the shard group % k
    world_size: int  # W, the shard group's size

    @property
    def segments(self) -> int:
        """The segments of a bucket a member keeps: ``W / k``."""
        return self.world_size // self.size


# shard (engine) group -> k -> this rank's k-group; weak keys, as the engine groups
_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[int, PostForwardGroup]] = weakref.WeakKeyDictionary()


def post_forward_group(process_group: dist.ProcessGroup, k: int) -> PostForwardGroup:
    """This rank's group of ``k`` consecutive ranks of ``process_group`` (made on first use, on
    every rank of it in the same order)."""
    by_k = _GROUPS.setdefault(process_group, {})
    found = by_k.get(k)
    if found is not None:
        return found
    W, rank = process_group.size(), process_group.rank()
    ranks = dist.get_process_group_ranks(process_group)  # in group-rank order
    backend = dist.get_backend(process_group)
    timeout = datetime.timedelta(seconds=collective_timeout_s())
    mine: dist.ProcessGroup | None = None
    for g in range(W // k):  # every k-group, on every rank, in this order
        made = dist.new_group(
            ranks[g * k : (g + 1) * k], timeout=timeout, backend=backend, use_local_synchronization=True
        )
        if g == rank // k:
            mine = made
    if mine is None or mine.rank() != rank % k:  # new_group sorts ranks: group-rank order must be sorted
        raise AssertionError(f"the post-forward group of rank {rank} over ranks {ranks} is not its rank // {k}-th")
    found = by_k[k] = PostForwardGroup(k, mine, rank % k, W)
    return found


def run_slices(layout: GroupLayout, pf: PostForwardGroup) -> list[tuple[slice, slice]]:
    """Per bucket: (its slice of the gathered buffer, this member's run in the run buffer)."""
    W, n = layout.world_size, pf.segments
    out = []
    for b, S_b in enumerate(layout.buckets):
        off = layout.bucket_local_offset(b)
        out.append((slice(W * off, W * (off + S_b)), slice(n * off, n * (off + S_b))))
    return out


def keep_run(gathered: torch.Tensor, layout: GroupLayout, pf: PostForwardGroup) -> torch.Tensor:
    """The run this member keeps after forward: per bucket, its ``W / k`` segments of the gathered
    bucket, copied into one buffer ``[W / k * S]``."""
    n = pf.segments
    run = torch.empty(n * layout.segment_numel, dtype=gathered.dtype, device=gathered.device)
    for full, part in run_slices(layout, pf):
        bucket = gathered[full]
        size = bucket.numel() // pf.size  # W / k * S_b
        run[part].copy_(bucket[pf.member * size : (pf.member + 1) * size])
    return run
