"""Ranks whose collectives do not line up (for test_integrity.py): each returns what it raised."""

from __future__ import annotations

import os
import time

import torch
from torch import nn

TIMEOUT_S = 5.0  # BLOCKSHARD_COLLECTIVE_TIMEOUT_S for these runs


class Tower(nn.Module):
    """Three identical 16 x 16 layers (so a rank that skips one still pairs equal-sized buffers)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.skip: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i != self.skip:
                x = torch.tanh(layer(x))
        return x


def _setup():
    import blockshard

    os.environ["BLOCKSHARD_COLLECTIVE_TIMEOUT_S"] = str(TIMEOUT_S)
    model = Tower()
    for layer in model.layers:
        blockshard.fully_shard(layer)
    blockshard.fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: nn.Module, opt: torch.optim.Optimizer, extra_forward: bool = False) -> None:
    x = torch.ones(4, 16)
    if extra_forward:
        model(x)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def case(rank: int, world: int, name: str) -> dict:
    """Three steps; in step 2 rank 1 misbehaves as ``name`` says. Returns rank's outcome."""
    model, opt = _setup()
    start = time.monotonic()
    try:
        for step in range(3):
            odd = rank == 1 and step == 1
            if odd and name == "skipped_step":
                continue
            if odd and name == "unused_module":
                model.skip = 1
            if odd and name == "requires_grad":
                model.layers[0].weight.requires_grad_(False)
            if odd and name == "dead_peer":
                os._exit(3)
            _step(model, opt, extra_forward=odd and name == "extra_forward")
            model.skip = None
        outcome = "no error"
    except Exception as exc:  # the test asserts the type and the text
        outcome = f"{type(exc).__name__}: {exc}"
    return {"outcome": outcome, "seconds": time.monotonic() - start}
