"""Sharding a prepared model and checkpointing it, per engine (ragged: ``blockshard.fully_shard``;
fsdp2: ``blockshard.integrations.fsdp2.fully_shard``)."""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from blockshard.integrations.accelerate._settings import AccelerateConfigError, AccelerateSettings

__all__ = ["load_model", "save_model", "shard_model"]


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


def shard_model(model: nn.Module, settings: AccelerateSettings) -> None:
    """Shard every layer module bottom-up (deepest first), then the root, as one group each."""
    kwargs = settings.fully_shard_kwargs()
    layers = _layers(model, settings)
    depth = {id(m): n.count(".") for n, m in model.named_modules()}
    layers.sort(key=lambda m: -depth[id(m)])
    if settings.engine == "ragged":
        import blockshard

        for layer in layers:
            blockshard.fully_shard(layer, **kwargs)
        blockshard.fully_shard(model, **kwargs)
    else:
        from blockshard.integrations import fsdp2

        for layer in layers:
            fsdp2.fully_shard(layer, root=model, **kwargs)
        fsdp2.fully_shard(model, **kwargs)


def _optimizer_arg(optimizers: list[torch.optim.Optimizer]):
    return None if not optimizers else optimizers[0] if len(optimizers) == 1 else optimizers


def save_model(model: nn.Module, path: str, optimizers: list, settings: AccelerateSettings | None) -> None:
    """The model's and optimizers' sharded state as one atomic DCP checkpoint at ``path``."""
    if settings is not None and settings.engine == "ragged":
        import blockshard

        blockshard.save_checkpoint(model, path, _optimizer_arg(optimizers))
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizers)
    partial = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.partial")
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=partial)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(partial, path)
    dist.barrier()


def load_model(model: nn.Module, path: str, optimizers: list, settings: AccelerateSettings | None) -> None:
    if not os.path.isdir(path):
        raise AccelerateConfigError(
            f"load_state found no blockshard checkpoint at {path}; load a directory written by save_state of a "
            "blockshard-sharded model"
        )
    if settings is not None and settings.engine == "ragged":
        import blockshard

        blockshard.load_checkpoint(model, path, _optimizer_arg(optimizers))
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizers)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
