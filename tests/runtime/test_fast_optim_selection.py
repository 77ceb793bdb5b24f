"""Optimizer selection in-process: ``muon_param_groups`` before and after sharding, ``global_shapes``,
and the optimizer guard ([Note: optimizer guard], blockshard/runtime/core/_optim_guard.py) at W = 1 on the
test thread's gloo group and at W = 2 on threaded ranks. The spawned tiny-Llama versions (bitwise
against one process) are in tests/optim/test_selection.py (slow tier)."""

from __future__ import annotations

import _inproc
import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_pre_hooks

import blockshard
from blockshard._errors import SemanticsError
from blockshard._tiny import OddMLP, mlp_batches
from blockshard.optim import muon_param_groups, optimizer_semantics
from blockshard.runtime import ShardingError, global_shapes
from blockshard.runtime.core import _optim_guard as guard

pytestmark = pytest.mark.timeout(60)  # in-process ranks: a hang fails the test, never the run

MATRICES = ["blocks.0.0.weight", "blocks.1.0.weight", "blocks.2.0.weight"]


def _shard(model: OddMLP) -> list[dict]:
    """Per block with Muon's semantics; returns the param_groups taken before sharding."""
    before = muon_param_groups(model)
    semantics = optimizer_semantics(before)
    for block in model.blocks:  # whole matrices on one rank each (auto may compute some at owners)
        blockshard.fully_shard(block, semantics=semantics, policy="whole")
    blockshard.fully_shard(model, semantics=semantics, policy="whole")
    return before


def _step(model: nn.Module, opts: list[torch.optim.Optimizer]) -> None:
    x, y = mlp_batches(1, 4)[0]
    ((model(x) - y) ** 2).mean().backward()
    for o in opts:
        o.step()
        o.zero_grad()


def test_muon_param_groups_select_hidden_matrices_by_name_before_sharding():
    model = nn.ModuleDict({"embed": nn.Embedding(11, 4), "proj": nn.Linear(4, 4), "lm_head": nn.Linear(4, 11)})
    muon, rest = muon_param_groups(model)
    assert muon["param_names"] == ["proj.weight"] and muon["optimizer"] == "muon"
    assert rest["param_names"] == ["embed.weight", "proj.bias", "lm_head.weight", "lm_head.bias"]
    assert len(muon["params"]) == 1 and muon["params"][0] is model["proj"].weight and rest["optimizer"] == "adamw"
    torch.optim.Muon([muon], lr=0.02), torch.optim.AdamW([rest])  # torch takes the param_groups as they are


def test_after_sharding_at_w1_the_groups_hold_the_local_pieces(gloo_w1):
    model = OddMLP()
    before = _shard(model)
    after = muon_param_groups(model)
    assert [g["param_names"] for g in after] == [g["param_names"] for g in before]
    assert after[0]["param_names"] == MATRICES
    current = {id(p) for p in model.parameters()}
    assert all(id(p) in current for g in after for p in g["params"])
    assert not any(id(p) in current for g in before for p in g["params"])  # sharding replaced them
    assert global_shapes(model)["blocks.1.0.weight"] == (29, 37)


def _w2_selection(rank: int, world: int) -> dict:
    with _inproc.serial():
        model = OddMLP()
    before = _shard(model)
    after = muon_param_groups(model)
    shapes = global_shapes(model)
    opts = [torch.optim.Muon([after[0]], lr=0.02), torch.optim.AdamW([after[1]], lr=1e-3)]
    _step(model, opts)  # a rank holding none of Muon's matrices still gets a valid Muon
    return {
        "before": [g["param_names"] for g in before],
        "after": [g["param_names"] for g in after],
        "muon_shapes": [tuple(p.shape) for p in after[0]["params"]],
        "local": {n: tuple(p.shape) for n, p in model.named_parameters()},
        "global": shapes,
    }


def test_at_w2_every_rank_splits_by_global_shape_and_empty_pieces_stay_out_of_adamw():
    outs = _inproc.run_ranks(_w2_selection, 2)
    want = {n: tuple(p.shape) for n, p in OddMLP().named_parameters()}
    for out in outs:
        assert out["before"][0] == MATRICES and out["global"] == want
        assert out["after"][1] == out["before"][1]  # the rest, empty pieces included, on every rank
        held = [n for n in MATRICES if out["local"][n] != (0,)]
        assert out["after"][0] == held and out["muon_shapes"] == [want[n] for n in held]
        assert not set(MATRICES) & set(out["after"][1])  # no matrix (nor empty piece of one) to AdamW
    assert sorted(n for out in outs for n in out["after"][0]) == sorted(MATRICES)  # each on one rank
    assert any(len(out["after"][0]) < len(MATRICES) for out in outs)  # control: some rank holds fewer


def _w2_rows(rank: int, world: int) -> str:
    with _inproc.serial():
        model = OddMLP()
    for block in model.blocks:
        blockshard.fully_shard(block, semantics="rows:1")  # row stripes: Muon would see part of a matrix
    blockshard.fully_shard(model)
    try:
        muon_param_groups(model)
    except SemanticsError as exc:
        return str(exc)
    return "no error"


def test_a_piece_that_is_not_the_whole_matrix_is_refused():
    msgs = _inproc.run_ranks(_w2_rows, 2)
    assert all("Muon must see whole matrices" in m and "optimizer_semantics" in m for m in msgs), msgs


def test_an_optimizer_over_the_pre_sharding_parameters_raises_at_its_first_step(gloo_w1):
    model = OddMLP()
    stale = torch.optim.AdamW(model.parameters(), lr=1e-3)
    named = torch.optim.SGD(model.named_parameters(), lr=1e-3)
    _shard(model)
    with pytest.raises(ShardingError, match=r"AdamW holds a parameter of shape \(37, 13\)") as info:
        _step(model, [stale])
    assert "build the optimizer after fully_shard, over model.parameters()" in str(info.value)
    with pytest.raises(ShardingError, match=r"SGD holds parameter 'blocks.0.0.weight' of shape \(37, 13\)"):
        _step(model, [named])
    _step(model, [torch.optim.AdamW(model.parameters(), lr=1e-3)])  # control: built after sharding


def test_the_guard_checks_once_per_parameter_count_and_is_installed_once(gloo_w1, monkeypatch):
    model = OddMLP()
    _shard(model)
    blockshard.fully_shard(nn.Linear(2, 2))  # a second fully_shard installs nothing more
    assert sum(h is guard._pre_step for h in _global_optimizer_pre_hooks.values()) == 1
    calls = []
    monkeypatch.setattr(guard, "check_optimizer", lambda opt: calls.append(opt) or ())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        _step(model, [opt])
    assert calls == [opt]  # cached after the first step
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    _step(model, [opt])
    assert calls == [opt, opt]  # a new param_group is checked again


def _optimizer_between_layers_and_root(rank: int, world: int) -> str:
    from blockshard._tiny import text_batches, tiny_llama

    with _inproc.serial():
        model = tiny_llama()
    semantics = optimizer_semantics(muon_param_groups(model))
    for layer in model.model.layers:
        blockshard.fully_shard(layer, semantics=semantics)
    opt = torch.optim.AdamW(model.model.layers.parameters(), lr=1e-3)  # before the root, which rotates layer 1
    blockshard.fully_shard(model, semantics=semantics)
    ids, labels = text_batches(1, 2, 8)[0]
    model(input_ids=ids, labels=labels).loss.backward()
    try:
        opt.step()
    except ShardingError as exc:
        return str(exc)
    return "no error"


@pytest.mark.heavy  # in process, seconds: out of `make test-fast` (its one-minute budget)
def test_an_optimizer_built_before_the_root_is_sharded_raises():
    msgs = _inproc.run_ranks(_optimizer_between_layers_and_root, 2)
    assert all("fully_shard replaced" in m for m in msgs), msgs


def _muon_on_owner_cut_stripes(rank: int, world: int, wrap: bool) -> str:
    with _inproc.serial():
        torch.manual_seed(0)
        model = nn.Linear(8, 6, bias=False)  # 48 elements: each of 2 ranks holds a (3, 8) row stripe
    blockshard.fully_shard(model, semantics="matrix", policy="owner")
    if wrap:
        from blockshard.optim import OwnerComputeOptimizer

        opt = OwnerComputeOptimizer(lambda groups: torch.optim.Muon(groups, lr=0.02), model.named_parameters())
    else:
        opt = torch.optim.Muon(model.parameters(), lr=0.02)  # torch accepts the 2-D stripe
    model(torch.ones(2, 8)).sum().backward()
    try:
        opt.step()
    except ShardingError as exc:
        return str(exc)
    return f"stepped {tuple(next(model.parameters()).shape)}"


def test_torch_muon_on_a_stripe_of_an_owner_computed_matrix_raises_on_every_rank():
    """Newton-Schulz on this rank's stripe alone is silently wrong; OwnerComputeOptimizer (the
    control) steps the same pieces."""
    for msg in _inproc.run_ranks(_muon_on_owner_cut_stripes, 2, args=(False,)):
        assert "Muon holds this rank's piece (3, 8) of 'weight' (global shape (6, 8))" in msg, msg
        assert "blockshard.optim.OwnerComputeOptimizer" in msg
    assert _inproc.run_ranks(_muon_on_owner_cut_stripes, 2, args=(True,)) == ["stepped (3, 8)"] * 2


def _w2_owner_compute_over_muon_group(rank: int, world: int) -> dict:
    from blockshard.optim import OwnerComputeOptimizer

    out: dict = {}
    for wrap in (True, False):
        with _inproc.serial():
            model = OddMLP()
        _shard(model)
        muon_group, rest = muon_param_groups(model)  # whole-placed: a rank may hold none of the matrices
        if wrap:
            muon = OwnerComputeOptimizer(lambda groups: torch.optim.Muon(groups, lr=0.02), [muon_group])
        else:
            muon = torch.optim.Muon([muon_group], lr=0.02)  # the control: torch's Muon on the whole matrices
        _step(model, [muon, torch.optim.AdamW([rest], lr=1e-3)])
        out[wrap] = {"held": len(muon_group["params"]), "state": blockshard.full_state_dict(model)}
    return out


def test_owner_compute_optimizer_on_a_rank_holding_none_of_its_parameters():
    """muon_param_groups leaves a rank no matrix when all are whole-placed elsewhere: the wrapper
    steps there (no collective: nothing is owner-computed) as torch's Muon does, bitwise. It used
    to fail on that rank (``holdings[0]``) while the other waited in the owner-plan check until the
    gloo timeout."""
    outs = _inproc.run_ranks(_w2_owner_compute_over_muon_group, 2)
    assert min(out[True]["held"] for out in outs) == 0  # the case: one rank holds none of Muon's matrices
    want = outs[0][False]["state"]
    for got in (outs[0][True], outs[1][True], outs[1][False]):
        assert all(torch.equal(got["state"][n], want[n]) for n in want)
