"""Meta-device init runs (for test_meta_init.py, spawned, and test_fast_meta_init.py, in-process).

A model built under ``torch.device("meta")``, sharded, materialized with ``to_empty`` and filled
by ``blockshard.init_parameters`` must hold, with the same seed, the values the unsharded model
gets from ``torch.manual_seed(seed); build()``: torch's modules draw their initial values in
``reset_parameters`` in construction order, which is ``model.modules()`` order.
"""

from __future__ import annotations

import torch
from torch import nn

SEED = 7
STEPS = 3


class Net(nn.Module):
    """Awkward sizes (37, 29, 13) so every W in {2, 3, 4} cuts tensors raggedly."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 13)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(13, 29), nn.GELU(), nn.Linear(29, 13), nn.LayerNorm(13)) for _ in range(2)]
        )
        self.head = nn.Linear(13, 37)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def reference() -> Net:
    torch.manual_seed(SEED)
    return Net()


def meta_sharded(semantics: object = None) -> Net:
    import blockshard

    with torch.device("meta"):
        model = Net()
    for block in model.blocks:
        blockshard.fully_shard(block, semantics=semantics)
    blockshard.fully_shard(model, semantics=semantics)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    blockshard.init_parameters(model)
    return model


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 37, (4, 6), generator=g) for _ in range(STEPS)]


def train(model: nn.Module) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for ids in _batches():
        nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return model


def sharded_run(rank: int, world: int, semantics: tuple = (None, "matrix")) -> dict:
    """One spawn, one model per semantics (element-wise and whole-matrix layouts)."""
    import blockshard

    out = {}
    for sem in semantics:
        model = meta_sharded(sem)
        init = {k: v.clone() for k, v in blockshard.full_state_dict(model).items()}
        train(model)
        out[sem] = {"init": init, "trained": blockshard.full_state_dict(model)}
    return out


def reference_run(_rank: int, _world: int) -> dict:
    model = reference()
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    train(model)
    return {"init": init, "trained": {k: v.detach().clone() for k, v in model.state_dict().items()}}
