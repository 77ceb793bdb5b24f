"""Spawned-rank runs for test_list_groups.py: a tiny Llama with ``fully_shard([model.norm,
lm_head])``, trained with blockshard, FSDP2 or on one process; the all-gathers of one step counted."""

from __future__ import annotations

import _inproc
import torch

import blockshard
from blockshard._tiny import text_batches, tiny_llama

STEPS = 3


def _shard(model, engine: str) -> None:
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = blockshard.fully_shard
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard([model.model.norm, model.lm_head])
    fully_shard(model)


def _train(model) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids, labels in text_batches(STEPS, 2, 16):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _all_gathers_per_step(model) -> int:
    ids, labels = text_batches(1, 2, 16, seed=9)[0]
    with _inproc.CollectiveLog() as log:
        model(input_ids=ids, labels=labels).loss.backward()
    for p in model.parameters():
        p.grad = None
    return log.count("all_gather")


def reference_run(_rank: int = 0, _world: int = 1) -> dict:
    model, init = tiny_llama(), tiny_llama().state_dict()
    losses = _train(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    moved = [k for k in ("lm_head.weight", "model.norm.weight") if not torch.equal(state[k], init[k])]
    return {"losses": losses, "state": state, "moved": moved}


def sharded_run(rank: int, world: int, engine: str) -> dict:
    model = tiny_llama()
    _shard(model, engine)
    losses = _train(model)
    out: dict = {"losses": losses, "all_gathers": _all_gathers_per_step(model)}
    if engine == "blockshard":
        out["state"] = blockshard.full_state_dict(model)
        out["layouts"] = list(blockshard.group_layouts(model))
    return out
