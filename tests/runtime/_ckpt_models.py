"""The model the checkpoint tests save and load: ``OddMLP`` (odd shapes, three blocks) sharded
bottom-up with ``bnb8bit`` semantics, built under ``_inproc.serial()`` (thread ranks share torch's
generator)."""

from __future__ import annotations

import _inproc
from torch import nn

import blockshard
from blockshard._tiny import OddMLP


def sharded_odd_mlp(seed: int = 0) -> nn.Module:
    with _inproc.serial():
        model = OddMLP(seed)
    for block in model.blocks:
        blockshard.fully_shard(block, semantics="bnb8bit")
    return blockshard.fully_shard(model)
