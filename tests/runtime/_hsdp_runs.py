"""HSDP runs for test_hsdp.py: 4 spawned gloo ranks as a (replicate=2, shard=2) mesh."""

from __future__ import annotations

import torch
from torch import nn

STEPS = 3
BATCH = 8


def _model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(13, 29), nn.Tanh(), nn.Linear(29, 7), nn.Tanh(), nn.Linear(7, 3))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 13, generator=g), torch.randn(BATCH, 3, generator=g)) for _ in range(STEPS)]


def _train(model: nn.Module, rank: int | None, world: int, micro: bool = False) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in _batches():
        if rank is not None:  # split: this rank's share of the batch
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        if micro:  # two micro-batches; the first reduce-scatters but does not all-reduce
            for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
                model.set_requires_all_reduce(i == 1)
                (((model(xm) - ym) ** 2).mean() / 2).backward()
        else:
            ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model


def reference(_rank: int, _world: int) -> dict:
    return {n: p.detach().clone() for n, p in _train(_model(), None, 1).named_parameters()}


def sharded(rank: int, world: int, mode: str) -> dict:
    """``mode``: "whole" (every rank the whole batch), "split" (each rank a quarter), "micro"
    (split, two micro-batches, all-reduce only on the second), or "shard_only" (the control:
    a 1-D mesh over each replica's two ranks, no all-reduce across replicas, split batch)."""
    from torch.distributed.device_mesh import init_device_mesh

    import blockshard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    use = mesh["shard"] if mode == "shard_only" else mesh
    model = _model()
    for i in (0, 2, 4):
        blockshard.fully_shard(model[i], mesh=use)
    blockshard.fully_shard(model, mesh=use)
    split = None if mode == "whole" else rank
    _train(model, split, world, micro=mode == "micro")
    counts = blockshard.collective_counts(model)  # before full_state_dict's gathers: training's only
    return {
        "params": blockshard.full_state_dict(model),
        "shapes": [tuple(p.shape) for p in model.parameters()],
        "counts": counts,
    }


def cases(rank: int, world: int) -> dict:
    return {mode: sharded(rank, world, mode) for mode in ("whole", "split", "micro", "shard_only")}
