"""Sharding a prepared model and checkpointing it, per engine (ragged: ``blockshard.fully_shard``;
fsdp2: ``blockshard.integrations.fsdp2.fully_shard``)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import blockshard
from blockshard.runtime.checkpoint._dcp import Optimizers, check_on_every_rank
from blockshard.runtime.checkpoint._files import atomic_save, base_record

from .. import fsdp2
from . import _weights
from ._settings import AccelerateConfigError, AccelerateSettings

__all__ = ["checkpoint_layers", "load_model", "save_model", "shard_model"]


def _layers(model: nn.Module, settings: AccelerateSettings) -> list[nn.Module]:
    wanted = set(settings.layers)
    found = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
    missing = sorted(wanted - {type(m).__name__ for m in found})
    if missing:
        raise AccelerateConfigError(
            f"fsdp_transformer_layer_cls_to_wrap names {missing} in {settings.source}, but the prepared model "
            f"({type(model).__name__}) has no module of that class; name its layer classes (e.g. LlamaDecoderLayer)"
        )
    return found


def checkpoint_layers(model: nn.Module, settings: AccelerateSettings) -> None:
    """``fsdp_activation_checkpointing``: wrap every layer module in torch's ``checkpoint_wrapper``
    (non-reentrant) before sharding, as accelerate's FSDP2 path does (``fsdp2_apply_ac``). The
    wrapped layer is sharded inside the wrapper, so the recompute in backward runs its forward under
    blockshard's hooks again ([Note: recompute] in ``blockshard/runtime/core/_state.py``). Parameter
    names gain ``_checkpoint_wrapped_module.``; ``state_dict()`` keys do not (the wrapper's hooks)."""
    if not settings.activation_checkpointing:
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    depth = {id(m): n.count(".") for n, m in model.named_modules()}
    names = {id(m): n for n, m in model.named_modules()}
    for layer in sorted(_layers(model, settings), key=lambda m: -depth[id(m)]):  # deepest first: names stay valid
        model.set_submodule(names[id(layer)], checkpoint_wrapper(layer))


def shard_model(model: nn.Module, settings: AccelerateSettings, device: torch.device | None = None) -> None:
    """Shard every layer module bottom-up (deepest first), then the root, as one group each; with
    ``fsdp_sync_module_states`` / ``fsdp_cpu_ram_efficient_loading`` every rank's shards then hold rank
    0's weights ([Note: weights from rank 0] in ``_weights.py``)."""

    kwargs = settings.fully_shard_kwargs()
    layers = _layers(model, settings)
    depth = {id(m): n.count(".") for n, m in model.named_modules()}
    layers.sort(key=lambda m: -depth[id(m)])
    full: dict[str, torch.Tensor] = {}
    if settings.cpu_ram_efficient_loading:
        full = _weights.full_tensors(model)
    elif settings.sync_module_states:
        _weights.broadcast_module_states(model)
    if settings.engine == "ragged":
        for layer in layers:
            blockshard.fully_shard(layer, **kwargs)
        blockshard.fully_shard(model, **kwargs)
    else:
        for layer in layers:
            fsdp2.fully_shard(layer, root=model, **kwargs)
        fsdp2.fully_shard(model, **kwargs)
    if settings.cpu_ram_efficient_loading:
        _weights.fill_from_rank0(model, full, device or torch.device("cpu"))
        full.clear()


def _optimizer_arg(optimizers: list[torch.optim.Optimizer]) -> Optimizers:
    return None if not optimizers else optimizers[0] if len(optimizers) == 1 else optimizers


def save_model(
    model: nn.Module, path: str, optimizers: list[torch.optim.Optimizer], settings: AccelerateSettings | None
) -> None:
    """The model's and optimizers' sharded state as one atomic DCP checkpoint at ``path``."""
    if settings is not None and settings.engine == "ragged":
        blockshard.save_checkpoint(model, path, _optimizer_arg(optimizers))
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizers)
    atomic_save(  # the same swap as blockshard.save_checkpoint: never replaces other files
        path,
        lambda partial: dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=partial),
        lambda: base_record("blockshard.integrations.accelerate", optimizers),
    )


def load_model(
    model: nn.Module, path: str, optimizers: list[torch.optim.Optimizer], settings: AccelerateSettings | None
) -> None:
    if not os.path.isdir(path):
        raise AccelerateConfigError(
            f"load_state found no blockshard checkpoint at {path}; load a directory written by save_state of a "
            "blockshard-sharded model"
        )
    if settings is not None and settings.engine == "ragged":
        blockshard.load_checkpoint(model, path, _optimizer_arg(optimizers))
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizers)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    check_on_every_rank(path)  # one checkpoint on every rank, its checksums ([Note: checkpoint integrity])
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
