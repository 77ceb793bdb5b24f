"""What both ZeRO hooks refuse (ZeRO-1/2 in _hook.py, ZeRO-3 in _stage3.py), by name."""

from __future__ import annotations

from typing import Any

import torch

from blockshard.optim import OwnerComputeOptimizer

from ._config import DeepSpeedHookError

__all__ = ["refuse_shared"]


def refuse_shared(
    init_optimizer: torch.optim.Optimizer, kwargs: dict[str, Any], where: str, offload: tuple[str, ...]
) -> None:
    """Raise for what neither hook supports: offload (the engine's ``offload`` config keys, e.g.
    ``"offload_optimizer_config"``), ZenFlow, blockshard's own owner-compute optimizers
    (``blockshard.optim.Muon``, ``OwnerComputeOptimizer``) and DeepSpeed's own Muon
    (``MuonWithAuxAdam``, parameters tagged ``use_muon``): ``where`` names the hook in the message."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    for key in offload:
        off = kwargs.get(key)
        if off is not None and getattr(off, "device", OffloadDeviceEnum.none) != OffloadDeviceEnum.none:
            what = key.removesuffix("_config")
            raise DeepSpeedHookError(
                f"zero_optimization.{what} is not supported by {where}; remove it or the blockshard section"
            )
    if kwargs.get("zenflow_config") is not None:
        raise DeepSpeedHookError(f"ZenFlow is not supported by {where}")
    if isinstance(init_optimizer, OwnerComputeOptimizer):
        raise DeepSpeedHookError(
            f"inner optimizer {type(init_optimizer).__name__} is blockshard's own owner-compute for "
            "blockshard.fully_shard and stock FSDP2 (it steps the parameters it was built over and exchanges "
            f"their pieces among ranks itself), so it cannot step DeepSpeed's partitions; {where} computes "
            "whole units itself: pass the plain optimizer (torch.optim.Muon for blockshard.optim.Muon)"
        )
    if type(init_optimizer).__name__ == "MuonWithAuxAdam":
        raise DeepSpeedHookError(
            "inner optimizer MuonWithAuxAdam steps DeepSpeed's single flat tensor per param_group; with blockshard "
            'pass torch.optim.Muon (ZeRO-1/2: with "semantics": "matrix")'
        )
    for g in init_optimizer.param_groups:
        for p in g["params"]:
            if getattr(p, "use_muon", False):
                raise DeepSpeedHookError(
                    "parameters tagged use_muon select DeepSpeed's own flat-partition Muon path, which the "
                    "blockshard hook does not support; pass torch.optim.Muon as the optimizer instead"
                )
