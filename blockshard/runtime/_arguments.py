"""``fully_shard``'s argument checks that stand alone: the mesh, FSDP2's arguments, ignored
parameters, HSDP's replicate group, and ``quantized_gather`` with nothing to quantize."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from blockshard._errors import LayoutMismatchError, QuantizedWeightError, ShardingError
from blockshard.runtime.core._buffers import ParamBuffers
from blockshard.runtime.core._collectives import engine_group
from blockshard.runtime.core._state import state_of
from blockshard.runtime.quantized._gather import QuantizedGatherBuffers

__all__ = [
    "check_fsdp_arguments",
    "check_post_forward",
    "check_quantized_below",
    "check_same_settings",
    "ignored_ids",
    "process_group_of",
    "replicate_group_of",
    "reshard_after_forward_of",
]


def process_group_of(mesh: object) -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise ShardingError(
            "fully_shard needs an initialized process group: call torch.distributed.init_process_group "
            "(backend 'gloo' on CPU, 'nccl' on GPUs) first, e.g. under torchrun"
        )
    if mesh is None:
        world = dist.group.WORLD
        if world is None:
            raise ShardingError("the default process group is not initialized; call init_process_group first")
        return world
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        if mesh.ndim == 2:  # HSDP: (replicate, shard), as FSDP2
            return mesh.get_group(1)
        if mesh.ndim != 1:
            raise ShardingError(
                f"mesh has {mesh.ndim} dims {mesh.mesh_dim_names}; blockshard shards over a 1-D mesh, or "
                "replicates and shards over a 2-D (replicate, shard) mesh (HSDP). Pass one of those, e.g. "
                "mesh['dp_replicate', 'dp_shard']"
            )
        return mesh.get_group()
    raise ShardingError(f"mesh={mesh!r} must be None, a 1-D DeviceMesh or a ProcessGroup")


def reshard_after_forward_of(value: object, world_size: int) -> bool | int | None:
    """FSDP2's ``reshard_after_forward``; an int ``k`` as FSDP2 reads it (torch 2.13's
    ``_get_post_forward_mesh_info``): a factor of the shard group's size ``W``. ``1`` is ``False``
    (reshard to a world of one: keep the gathered parameters), ``W`` is ``True``, and any other
    factor stays an int: after forward the parameters are resharded to ``k`` ranks, and backward
    gathers them within those ``k`` ([Note: reshard to a smaller world] in core/_post_forward.py)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int) and 1 <= value <= world_size and world_size % value == 0:
        if value in (1, world_size):
            return value != 1  # 1 first, as FSDP2: a group of one rank keeps its parameters
        return value
    factors = [k for k in range(1, world_size + 1) if world_size % k == 0]
    raise ShardingError(
        f"reshard_after_forward={value!r} must be True, False, None, or an int that divides the shard group's "
        f"size {world_size} (1 <= k <= {world_size}: one of {factors}), as FSDP2 reads it: the number of ranks "
        "the parameters are resharded to after forward (1 is False, the group's size is True). Fix: pass True "
        "to free the gathered parameters after forward, False to keep them, None for FSDP2's default, or a "
        f"factor of {world_size} (e.g. the ranks of one node) to keep them sharded over that many ranks until "
        "backward"
    )


def check_post_forward(name: str, reshard_after_forward: bool | int | None, buffer_sets: Sequence[object]) -> None:
    """An int ``reshard_after_forward`` (a smaller world after forward) is refused for a group that
    gathers quantized tiles (``quantized_gather=True``) or holds frozen quantized weights: those
    buffer sets gather bytes of their own, not the float segments a kept run refills ([Note:
    reshard to a smaller world] in core/_post_forward.py); refused rather than resharded otherwise."""
    if isinstance(reshard_after_forward, bool) or not isinstance(reshard_after_forward, int):
        return
    for b in buffer_sets:
        if isinstance(b, QuantizedGatherBuffers) or not isinstance(b, ParamBuffers):
            what = "quantized_gather=True" if isinstance(b, QuantizedGatherBuffers) else "frozen quantized weights"
            raise ShardingError(
                f"fully_shard of {name}: reshard_after_forward={reshard_after_forward} (reshard to "
                f"{reshard_after_forward} ranks after forward) is not supported for a group with {what} yet: "
                "their buffers are gathered as quantized bytes, which the smaller world's kept run does not "
                "hold. Fix: pass reshard_after_forward=True (gather over the whole shard group in backward) or "
                "False for this group"
            )


def check_fsdp_arguments(offload_policy: object) -> None:
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        if type(offload_policy).__name__ != "CPUOffloadPolicy":
            raise ShardingError(
                f"offload_policy={offload_policy!r} must be torch's OffloadPolicy() or CPUOffloadPolicy()"
            )


def check_quantized_below(modules: Sequence[nn.Module], semantics: object) -> None:
    """``quantized_gather=True`` on a group with no tile-quantizer weight: fine for a root over
    groups that have some (the same arguments passed to every call), else it would do nothing."""
    below = (st for m in modules for sub in m.modules() if (st := state_of(sub)) is not None)
    if any(isinstance(g, QuantizedGatherBuffers) for st in below for g in st.buffer_sets):
        return
    raise QuantizedWeightError(
        f"quantized_gather=True on {', '.join(type(m).__name__ for m in modules)}: semantics={semantics!r} gives "
        "none of its parameters (nor of the groups sharded below it) a tile quantizer ('mx', 'mx:4' or "
        "'fp8_block:B'), so nothing would be gathered quantized. Fix: pass semantics={'*_proj.weight': "
        "'fp8_block:128'} (or 'mx'), or drop quantized_gather"
    )


def ignored_ids(ignored_params: object) -> set[int]:
    if ignored_params is None:
        return set()
    if isinstance(ignored_params, torch.Tensor) or not isinstance(ignored_params, (set, frozenset, list, tuple)):
        raise ShardingError(
            f"ignored_params={ignored_params!r} must be a set of the module's parameters (as FSDP2's), e.g. "
            "{model.pos_embed}"
        )
    for i, p in enumerate(ignored_params):
        if not isinstance(p, nn.Parameter):
            raise ShardingError(f"ignored_params holds a {type(p).__name__} (item {i}); it must hold nn.Parameters")
    return {id(p) for p in ignored_params}


def replicate_group_of(mesh: object) -> dist.ProcessGroup | None:
    """HSDP's replicate axis (dim 0 of a 2-D mesh), or None: gradients are all-reduced over it."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2 or mesh.size(0) == 1:
        return None
    return engine_group(mesh.get_group(0))


def check_same_settings(name: str, process_group: dist.ProcessGroup, **settings: object) -> None:
    """Raise :class:`LayoutMismatchError` on every rank unless every rank passed ``fully_shard`` the
    same per-group settings (``mp_policy``, ``reshard_after_forward``, ...; one
    ``all_gather_object`` at init). Ranks that differ there issue collectives of other sizes or at
    other times (a bf16 all-gather against an fp32 one: gloo aborts the process), so they are
    refused here, before the first collective of a step."""
    mine = {k: repr(v) for k, v in settings.items()}
    every: list[Any] = [None] * process_group.size()
    dist.all_gather_object(every, mine, group=process_group)
    differ = [k for k in mine if len({str(e.get(k)) for e in every}) > 1]
    if differ:
        shown = "; ".join(f"{k}: " + ", ".join(f"rank {r}: {e.get(k)}" for r, e in enumerate(every)) for k in differ)
        raise LayoutMismatchError(
            f"fully_shard of {name}: the ranks passed different settings ({shown}). Every rank must call "
            "fully_shard with the same arguments: pass the same values on every rank"
        )
