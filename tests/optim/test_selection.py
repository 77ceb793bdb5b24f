"""Optimizer selection that cannot silently go wrong (issue 9), on a tiny Llama sharded per layer
at W = 2 with every rank the whole batch (bitwise against one process).

* Muon + AdamW split by ``muon_param_groups(model)`` after sharding equals one process bitwise;
  control: the old ``p.ndim == 2`` split on local pieces gives Muon the embedding on the rank that
  holds it whole (measured 4.2e-2 from one process after 3 steps).
* ``muon_param_groups`` chooses the same names before and after sharding.
* An optimizer over the pre-sharding parameters raises at its first step on every rank.
* Stacked experts (issue 22, item 3): a tiny Mixtral on stock FSDP2, torch's Muon per expert through
  ``fsdp2.OwnerComputeOptimizer``, bitwise against one process (control: the flattened stack).
"""

from __future__ import annotations

import functools

import _selection_runs
import pytest
import torch

from blockshard._launch import run_single, spawn_gloo

pytestmark = pytest.mark.slow

EMBED = "model.embed_tokens.weight"


@functools.cache
def _reference() -> dict:
    return run_single(_selection_runs.reference, timeout=600)


@functools.cache
def _sharded() -> list[dict]:
    return spawn_gloo(_selection_runs.sharded, 2, args=(("helper", "ndim"),), timeout=600)


def _max_diff(got: dict, want: dict) -> float:
    return max((got[n] - want[n]).abs().max().item() for n in want)


def test_muon_param_groups_after_sharding_is_bitwise_one_process():
    want = _reference()
    for res in _sharded():
        got = res["helper"]["params"]
        bad = [n for n in want if not torch.equal(got[n], want[n])]
        assert not bad, f"{bad} differ, max {_max_diff(got, want):.3e}"


def test_control_the_ndim_split_on_local_pieces_gives_muon_the_embedding():
    want = _reference()
    holders = [res for res in _sharded() if res["ndim"]["embed_shape"] == (257, 48)]
    assert len(holders) == 1  # one rank holds the embedding whole, the other an empty piece
    assert _max_diff(holders[0]["ndim"]["params"], want) > 1e-3


def test_the_same_names_before_and_after_sharding():
    outs = _sharded()
    for res in outs:
        run = res["helper"]
        muon_before, rest_before = run["before"]
        muon_after, rest_after = run["after"]
        assert EMBED in rest_before and EMBED in rest_after and "lm_head.weight" in rest_after
        assert rest_after == rest_before  # empty pieces included
        assert muon_after == [n for n in muon_before if n not in run["empty"]]  # the matrices held here
    assert sorted(n for res in outs for n in res["helper"]["after"][0]) == sorted(outs[0]["helper"]["before"][0])


def test_an_optimizer_over_the_pre_sharding_parameters_raises_on_every_rank():
    for res in _sharded():
        msg = res["pre_sharding"]
        assert "AdamW holds a parameter of shape (257, 48)" in msg, msg
        assert "fully_shard replaced" in msg and "build the optimizer after fully_shard" in msg


def test_the_fsdp2_docstring_recipe_chooses_the_same_names_and_is_bitwise_one_process():
    want = _reference()
    for res in spawn_gloo(_selection_runs.fsdp2_recipe, 2, timeout=600):
        assert res["after"] == res["before"]  # DTensors have global shapes: nothing left out
        assert EMBED in res["after"][1] and "lm_head.weight" in res["after"][1]
        bad = [n for n in want if not torch.equal(res["params"][n], want[n])]
        assert not bad, f"{bad} differ, max {_max_diff(res['params'], want):.3e}"


def test_stacked_experts_on_stock_fsdp2_are_stepped_per_expert_bitwise_one_process():
    """Issue 22, item 3: muon_param_groups offers a tiny Mixtral's stacked experts to Muon (the same
    names before and after sharding); fsdp2.OwnerComputeOptimizer gives torch's Muon each expert's
    (m, n) matrix and equals one process running torch's Muon on every expert's matrix, bitwise.
    Control: Muon on the stack flattened to (E * m, n) differs by more than 1e-3."""
    want = run_single(_selection_runs.experts_reference, timeout=300)
    flat = run_single(_selection_runs.experts_reference, args=(False,), timeout=300)
    assert max((flat[n] - want[n]).abs().max().item() for n in _selection_runs.EXPERTS) > 1e-3
    for res in spawn_gloo(_selection_runs.fsdp2_experts, 2, timeout=300):
        assert set(_selection_runs.EXPERTS) <= set(res["before"]) and res["after"] == res["before"]
        assert all(len(s) == 2 for s in res["inner_shapes"]), res["inner_shapes"]
        bad = [n for n in want if not torch.equal(res["params"][n], want[n])]
        assert not bad, f"{bad} differ, max {_max_diff(res['params'], want):.3e}"
