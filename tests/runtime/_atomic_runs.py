"""A save killed midway on spawned gloo ranks (issue 11, [Note: atomic checkpoints]): every
function takes ``(rank, world, path)``."""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

import blockshard
from blockshard._tiny import OddMLP, mlp_batches
from blockshard.runtime import load_checkpoint, save_checkpoint


def _model(seed: int) -> nn.Module:
    model = OddMLP(seed)
    for block in model.blocks:
        blockshard.fully_shard(block)
    return blockshard.fully_shard(model)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x, y = mlp_batches(1, 4)[0]
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def killed_save(rank: int, world: int, path: str) -> None:
    """Save a checkpoint, train a step, save again into the same name: rank 1 is killed
    (SIGKILL) right after writing its data, before DCP's ``.metadata``; rank 0 then waits in the
    save until the launcher kills it too. Never returns."""
    from torch.distributed.checkpoint import FileSystemWriter

    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt)
    save_checkpoint(model, path, opt)
    full = blockshard.full_state_dict(model)
    if rank == 0:
        torch.save(full, f"{path}-first.pt")
    _step(model, opt)
    if rank == 1:
        write = FileSystemWriter.write_data

        def killed_after_writing(self, plan, planner):
            write(self, plan, planner).wait()
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = killed_after_writing
    save_checkpoint(model, path, opt)
    raise AssertionError("the second save was to be killed")


def load(rank: int, world: int, path: str) -> dict:
    model = _model(1)
    load_checkpoint(model, path, torch.optim.AdamW(model.parameters(), lr=0.1))
    return blockshard.full_state_dict(model)
