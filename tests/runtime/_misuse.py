"""Misuse and semantics checks run on spawned gloo ranks (see test_misuse.py)."""

from __future__ import annotations

import torch
from torch import nn


def _err(fn) -> str:
    try:
        fn()
    except Exception as exc:  # the tests assert the type name and the message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def misuse(rank: int, world: int) -> dict:
    import blockshard

    out = {}
    twice = nn.Linear(4, 5)
    blockshard.fully_shard(twice)
    out["twice"] = _err(lambda: blockshard.fully_shard(twice))

    top = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))
    blockshard.fully_shard(top)
    out["top_down"] = _err(lambda: blockshard.fully_shard(top[0]))

    shared = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    shared[1].weight = shared[0].weight
    blockshard.fully_shard(shared[0])
    out["shared"] = _err(lambda: blockshard.fully_shard(shared))

    odd = nn.Linear(4, 6)
    odd.weight = nn.Parameter(torch.randn(4, 6).t())  # a transposed view: not contiguous
    out["non_contiguous"] = _err(lambda: blockshard.fully_shard(odd))

    out["bad_mesh"] = _err(lambda: blockshard.fully_shard(nn.Linear(2, 2), mesh="world"))
    out["bad_semantics"] = _err(lambda: blockshard.fully_shard(nn.Linear(3, 5), semantics={"weight": "nf4"}))

    # tied weights inside one group are fine: one placement, two registrations
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    blockshard.fully_shard(tied)
    out["tied_params"] = len(list(tied.parameters()))
    out["tied_same"] = tied[0].weight is tied[1].weight
    return out


def semantics(rank: int, world: int) -> dict:
    import blockshard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 37), nn.GELU(), nn.Linear(37, 29), nn.Linear(29, 8))
    blockshard.fully_shard(model, semantics=lambda name, p: "matrix" if p.ndim == 2 else None, policy="whole")
    whole = [(tuple(p.shape)) for p in model.parameters()]
    stripes = nn.Linear(16, 12)  # rows:4 on a 12 x 16 weight: stripes of 4 rows
    blockshard.fully_shard(stripes, semantics={"weight": "rows:4"}, policy="whole")
    return {"whole": whole, "stripes": tuple(stripes.weight.shape)}


def mismatch(rank: int, world: int) -> None:
    import blockshard

    blockshard.fully_shard(nn.Linear(4, 5 + rank))  # every rank a different model


def unused(rank: int, world: int) -> dict:
    """A layer that never runs keeps ``.grad = None``: AdamW with weight decay leaves it alone,
    as on one process."""
    import blockshard

    class Partly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(6, 5), nn.Linear(6, 7)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    model = Partly()
    before = model.unused.weight.detach().clone()
    blockshard.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    for _ in range(2):
        model(torch.ones(3, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    full = blockshard.full_state_dict(model)
    return {"unchanged": torch.equal(full["unused.weight"], before), "used_changed": True}
