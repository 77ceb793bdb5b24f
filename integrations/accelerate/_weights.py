"""How rank 0's weights reach every rank: ``fsdp_sync_module_states`` and ``fsdp_cpu_ram_efficient_loading``.

[Note: weights from rank 0]
* ``fsdp_sync_module_states: true`` (every rank built the whole model, perhaps with other values:
  another seed): before sharding, every parameter and buffer is broadcast from rank 0
  (:func:`broadcast_module_states`), as FSDP1's ``sync_module_states`` does. Each rank already
  holds the whole model, so the broadcast costs no memory; afterwards every rank shards the same
  values and training equals one process started from rank 0's weights.
* ``fsdp_cpu_ram_efficient_loading: true`` (accelerate's meaning: only rank 0 loads the pretrained
  weights; ``transformers``' ``from_pretrained`` builds the model on the meta device on the other
  ranks under ``accelerate launch``): the model is sharded as it is (rank 0 real, the others on meta;
  the layout comes from shapes alone), the meta ranks materialize only their shards
  (``model.to_empty``, [Note: meta init] in ``blockshard/runtime/core/_init.py``) and
  :func:`fill_from_rank0` fills them through ``blockshard.init_parameters``: one group at a time it
  opens the group's gathered buffer on every rank, rank 0 copies its full tensors in, one broadcast
  per tensor sends them, and each rank keeps its own segment. So no rank but 0 holds more than its
  shards plus one group (the root's group stays open throughout, as in [Note: meta init]); rank 0
  holds the whole model until ``prepare()`` returns, as it did after loading. Buffers (held whole by
  every rank; non-persistent ones included, which ``from_pretrained`` zeroes on the meta ranks) are
  broadcast afterwards. Accelerate's FSDP2 path does the same with one broadcast per tensor
  (``fsdp2_load_full_state_dict``).
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import nn

import blockshard

from ._settings import AccelerateConfigError

__all__ = ["broadcast_module_states", "check_same_model", "fill_from_rank0", "full_tensors", "on_meta"]


def on_meta(model: nn.Module) -> list[str]:
    """Names of the parameters and buffers of ``model`` on the meta device."""
    return [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]


def _meta_anywhere(model: nn.Module, key: str) -> bool:
    """Whether any rank's model has meta tensors (collective; every rank raises if rank 0's has)."""
    mine = on_meta(model)
    flags = torch.tensor([1 if mine and dist.get_rank() == 0 else 0, 1 if mine else 0])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[0]:
        raise AccelerateConfigError(
            f"{key}=True: rank 0 holds the weights every rank receives, but its model has parameters or buffers "
            "on the meta device; load the weights on rank 0 (from_pretrained), or build the model for real there"
        )
    return bool(flags[1])


def check_same_model(model: nn.Module, key: str) -> None:
    """Every rank has the same parameter and buffer names and shapes (collective: one all-reduce),
    else every rank raises: rank 0's broadcasts would be paired with other tensors, or wait forever."""
    named = [*model.named_parameters(), *model.named_buffers()]
    signature = zlib.crc32(repr([(n, tuple(t.shape)) for n, t in named]).encode())
    both = torch.tensor([signature, -signature], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if both[0].item() != -both[1].item():
        raise AccelerateConfigError(
            f"{key}=True: the ranks' models differ (parameter and buffer names or shapes; this rank has "
            f"{len(named)} tensors), so rank 0's weights cannot be sent tensor by tensor. Fix: build the same "
            "model (same config and class) on every rank"
        )


@torch.no_grad()
def broadcast_module_states(model: nn.Module) -> None:
    """Every parameter and buffer of the (unsharded) model from rank 0, in ``named_parameters`` then
    ``named_buffers`` order (the same on every rank: the same model class). Collective."""
    if _meta_anywhere(model, "fsdp_sync_module_states"):
        raise AccelerateConfigError(
            "fsdp_sync_module_states=True: a rank's model has parameters or buffers on the meta device, so there "
            "is nothing to broadcast into before sharding; set fsdp_cpu_ram_efficient_loading: true as well "
            "(rank 0's weights then fill the shards), or build the model for real on every rank"
        )
    check_same_model(model, "fsdp_sync_module_states")
    for _, t in [*model.named_parameters(), *model.named_buffers()]:
        dist.broadcast(t.data, src=0)


def full_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """On rank 0, before sharding: the model's parameters and buffers by name (no copy: references
    kept until they are broadcast); an empty dict elsewhere. Collective (rank 0's model must be real)."""
    _meta_anywhere(model, "fsdp_cpu_ram_efficient_loading")
    check_same_model(model, "fsdp_cpu_ram_efficient_loading")
    if dist.get_rank() != 0:
        return {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {n: t.detach() for n, t in named}  # tied tensors under each of their names


@torch.no_grad()
def fill_from_rank0(model: nn.Module, full: dict[str, torch.Tensor], device: torch.device) -> None:
    """After sharding with the ragged engine: every rank's shards hold rank 0's values ``full``, taken
    by :func:`full_tensors` (see [Note: weights from rank 0])."""

    if on_meta(model):
        model.to_empty(device=device)
    rank0 = dist.get_rank() == 0
    prefix = {id(m): f"{n}." if n else "" for n, m in model.named_modules(remove_duplicate=False)}

    def fill(module: nn.Module) -> None:
        for attr, p in module.named_parameters(recurse=False):
            if rank0:
                p.copy_(full[prefix[id(module)] + attr])
            dist.broadcast(p.data, src=0)

    blockshard.init_parameters(model, init=fill)
    for name, b in model.named_buffers():
        if rank0:
            b.copy_(full[name])
        dist.broadcast(b.data, src=0)
