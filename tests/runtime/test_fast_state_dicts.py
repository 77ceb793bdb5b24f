"""State dict round trips in-process: W = 1 on the test thread's gloo group, W = 2 on threaded gloo
ranks (see _inproc.py), tied weights included. Tolerance: bitwise (a round trip copies).
Controls: before loading, the fresh model differs from the saved state."""

from __future__ import annotations

import _fast_scenarios as fs
import _inproc
import pytest
import torch
from _scenarios import _batches, _loss_fn, _model
from _torch_state_dict_runs import Tied
from torch import nn

import blockshard
from blockshard.runtime import ShardingError, load_full_state_dict, load_sharded_state_dict

pytestmark = pytest.mark.timeout(60)  # in-process ranks: a hang fails the test, never the run


def _build(kind: str, seed: int) -> nn.Module:
    with _inproc.serial():  # construction only: never hold it across a collective
        model = Tied(seed) if kind == "tied" else _model(kind) if seed == 0 else _seeded(kind, seed)
    if kind == "tied":
        blockshard.fully_shard(model.mid)
        return blockshard.fully_shard(model)
    return fs.shard(model, kind)


def _seeded(kind: str, seed: int) -> nn.Module:
    from blockshard._tiny import OddMLP, tiny_llama

    return tiny_llama(seed) if kind == "llama" else OddMLP(seed)


def _train_one_step(model: nn.Module, kind: str) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=fs.LR)
    if kind == "tied":
        ids = torch.arange(12).remainder(19).view(3, 4)
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    else:
        loss = _loss_fn(kind)(model, _batches(kind, fs.BATCH[kind])[0])
    loss.backward()
    opt.step()
    opt.zero_grad()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _round_trips(rank: int, world: int, kind: str) -> dict:
    saved_model = _build(kind, 0)
    _train_one_step(saved_model, kind)  # values that differ from any fresh initialisation
    full = blockshard.full_state_dict(saved_model)
    pieces = blockshard.sharded_state_dict(saved_model)
    out = {"full": full, "names": sorted(full)}
    fresh = _build(kind, 1)
    out["fresh_differs"] = not _same(blockshard.full_state_dict(fresh), full)
    load_full_state_dict(fresh, full)
    out["full_round_trip"] = _same(blockshard.full_state_dict(fresh), full)
    other = _build(kind, 2)
    load_sharded_state_dict(other, pieces)
    out["sharded_round_trip"] = _same(blockshard.full_state_dict(other), full)
    out["pieces_equal"] = all(
        torch.equal(v.tensor, blockshard.sharded_state_dict(other)[k].tensor) for k, v in pieces.items()
    )
    if kind == "tied":
        out["still_tied"] = other.embed.weight is other.head.weight and fresh.embed.weight is fresh.head.weight
        _train_one_step(other, kind)  # and the loaded model trains like the saved one
        _train_one_step(saved_model, kind)
        out["trains_alike"] = _same(blockshard.full_state_dict(other), blockshard.full_state_dict(saved_model))
    return out


def _on(world: int, kind: str) -> list[dict]:
    if world == 1:
        with _inproc.single_thread():
            return [_round_trips(0, 1, kind)]
    return _inproc.run_ranks(_round_trips, world, args=(kind,))


@pytest.fixture(autouse=True)
def _w1(gloo_w1):
    return gloo_w1


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", ["mlp", "llama", "tied"])
def test_full_and_sharded_state_dicts_round_trip_bitwise(kind, world):
    outs = _on(world, kind)
    for out in outs:
        assert out["fresh_differs"]  # control
        assert out["full_round_trip"] and out["sharded_round_trip"] and out["pieces_equal"]
        if kind == "tied":
            # the unsharded model's state_dict() names, the tied head included (issue 11), as one tensor
            assert out["names"] == ["embed.weight", "head.weight", "mid.bias", "mid.weight"]
            assert out["full"]["head.weight"] is out["full"]["embed.weight"]
            assert out["still_tied"] and out["trains_alike"]
    assert all(_same(out["full"], outs[0]["full"]) for out in outs)  # every rank the same full state


def test_a_full_state_dict_saved_at_w2_loads_at_w1():
    saved = _on(2, "mlp")[0]["full"]
    model = _build("mlp", 1)
    load_full_state_dict(model, saved)
    assert _same(blockshard.full_state_dict(model), saved)


def test_a_sharded_state_dict_of_another_world_size_is_refused():
    pieces = _inproc.run_ranks(lambda r, w: blockshard.sharded_state_dict(_build("mlp", 0)), 2)[0]
    with pytest.raises(ShardingError, match="the layout changed"):
        load_sharded_state_dict(_build("mlp", 1), pieces)
