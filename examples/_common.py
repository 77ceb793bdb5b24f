"""Shared by the examples: write the result a test compares across world sizes (rank 0 only)."""

from __future__ import annotations

import json

import torch


def write_result(
    path: str | None, *, world_size: int, losses: list[float], params: dict[str, torch.Tensor], **extra: object
) -> None:
    """``path`` (JSON): world size, losses, each parameter's float64 sum and ``extra``; ``path + ".pt"``:
    the parameters themselves, for a bitwise comparison. Nothing is written without ``path``."""
    if not path:
        return
    checksums = {name: p.double().sum().item() for name, p in params.items()}
    with open(path, "w") as f:
        json.dump({"world_size": world_size, "losses": losses, "checksums": checksums, **extra}, f, indent=1)
    torch.save({name: p.detach().cpu().clone() for name, p in params.items()}, path + ".pt")
