"""Owner-compute on the ragged engine: unmodified optimizers on whole compute units of cut storage.

``fully_shard(..., policy=...)`` with ``owner`` (every matrix's storage cut anywhere), ``whole``
(each matrix on one rank) and ``auto`` (on this model: the 96 x 40 matrix under owner, the 5 x 96
one whole), stepped by ``blockshard.optim.OwnerComputeOptimizer`` around torch Muon,
BlockedShampoo and bnb AdamW8bit. With the whole batch on every rank: bitwise equal to one
process at W in {2, 4}. At W = 3 the batch is split in three (averaging the ranks' gradients
rounds differently from one process's mean), held to the tolerances below.
"""

from __future__ import annotations

import functools

import _owner_runs
import pytest
import torch

from blockshard._launch import run_single, spawn_gloo

pytestmark = pytest.mark.slow

OPTIMIZERS = ["muon", "bsmuon", "shampoo", "bnb8bit"]
REFERENCE = {"bsmuon": "muon"}  # blockshard.optim.Muon computes torch.optim.Muon
POLICIES = ["owner", "whole", "auto"]
# W = 3, batch split: per-rank means averaged by the reduce-scatter differ from one process's mean
# by ulps. Measured after 3 steps (every policy): bnb8bit 1.5e-8; Shampoo amplifies the ulps
# through the inverse 4th roots of nearly singular float32 factors: 5.0e-4 to 5.9e-4; torch's Muon
# runs Newton-Schulz in bfloat16, where an ulp of the gradient can flip a rounding: 7.5e-9 on one
# CPU, 1.4e-3 on another (AVX512), the same for every policy and form. (Across policies the runs
# differ by ulps, 2.9e-10 for Muon: the layout decides which elements share a reduce-scatter chunk.)
W3_TOLERANCE = {"muon": 5e-3, "bsmuon": 5e-3, "shampoo": 2e-3, "bnb8bit": 1e-6}
CONTROL_MIN = 1e-3


@functools.cache
def _references() -> dict:
    return run_single(_owner_runs.references, args=(tuple(n for n in OPTIMIZERS if n not in REFERENCE),), timeout=600)


@functools.cache
def _runs(world: int) -> list[dict]:
    todo: tuple = tuple(("sharded", n, p, world == 3) for n in OPTIMIZERS for p in POLICIES)
    if world == 2:
        todo += (("control",), ("round_trip",), ("other_plan",))
    return spawn_gloo(_owner_runs.cases, world, args=(todo,), timeout=600)


def _sharded(name: str, policy: str, world: int) -> list[dict]:
    return [r[("sharded", name, policy, world == 3)] for r in _runs(world)]


def _max_diff(got: dict, want: dict) -> float:
    return max((got[n] - want[n]).abs().max().item() for n in want)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("world", [2, 4])
def test_bitwise_equal_to_one_process(world, name, policy):
    want = _references()[REFERENCE.get(name, name)]
    for res in _sharded(name, policy, world):
        bad = [n for n in want if not torch.equal(res["params"][n], want[n])]
        assert not bad, f"{name} {policy} W={world}: {bad} differ, max {_max_diff(res['params'], want):.3e}"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_three_ranks_with_the_batch_split_within_tolerance(name, policy):
    want = _references()[REFERENCE.get(name, name)]
    for res in _sharded(name, policy, 3):
        assert _max_diff(res["params"], want) <= W3_TOLERANCE[name]


@pytest.mark.parametrize("world", [2, 4])
def test_policies_place_the_matrices_as_asked_and_auto_mixes(world):
    owner = {p: _sharded("muon", p, world)[0]["owner"] for p in POLICIES}
    assert owner["whole"] == []
    assert owner["owner"] == ["0.0.weight", "0.2.weight", "1.weight"]
    assert "0.0.weight" in owner["auto"] and "0.2.weight" not in owner["auto"]  # auto mixes in group 0


@pytest.mark.parametrize("world", [2, 3, 4])
def test_owner_plan_is_identical_on_every_rank_and_every_cut_unit_has_one_owner(world):
    for policy in ("owner", "auto"):
        runs = _sharded("muon", policy, world)
        assert len({(r["owner_hash"], repr(r["units"])) for r in runs}) == 1
        units = {(n, a, k, o) for n, us in runs[0]["units"].items() for a, k, o in us}
        owned = [(n, a, k, r) for r, res in enumerate(runs) for n, a, k in res["owned"]]
        assert sorted(owned) == sorted(units) and len(set(owned)) == len(owned)
        for r, res in enumerate(runs):  # optimizer state of a cut unit only at its owner
            held = {(k[0], k[2], k[3]) for k in res["state_keys"] if k[1] == "unit"}
            assert held == {(n, a, k) for n, a, k, o in units if o == r}


def test_all_to_all_counts_match_the_plan():
    runs = _sharded("muon", "owner", 4)
    for r, res in enumerate(runs):
        for dt, (send, recv) in res["a2a"].items():
            assert send[r] == 0 and recv[r] == 0
            for o in range(4):
                assert send[o] == runs[o]["a2a"][dt][1][r]  # what r sends o is what o expects from r


def test_optimizer_state_round_trip_at_the_same_world_size():
    want = _references()["muon"]
    for res in _runs(2):
        got = res[("round_trip",)]["params"]
        assert all(torch.equal(got[n], want[n]) for n in want), _max_diff(got, want)


def test_a_rank_with_another_owner_plan_raises_on_every_rank():
    msgs = [res[("other_plan",)] for res in _runs(2)]
    assert all(m.startswith("raised: ") and "owner plan" in m for m in msgs), msgs


def test_control_plain_muon_on_row_sliced_shards_is_wrong():
    want = _references()["muon"]
    got = _runs(2)[0][("control",)]["params"]
    assert _max_diff(got, want) > CONTROL_MIN


@pytest.mark.parametrize("world", [2, 4])
def test_momentum_sharded_muon_keeps_its_state_on_the_storage_shards(world):
    for res in _sharded("bsmuon", "owner", world):  # momentum of exactly the elements a rank stores
        assert res["state_numel"] == res["matrix_numel"]
    torch_muon = [r["state_numel"] for r in _sharded("muon", "owner", world)]
    assert sum(torch_muon) == sum(r["matrix_numel"] for r in _sharded("bsmuon", "owner", world))  # whole, at owners


@pytest.mark.parametrize("world", [2, 4])
def test_the_engine_runs_the_plan_that_plan_model_shows(world):
    """``blockshard plan`` (``plan_model``) and ``fully_shard`` build the same layouts and the same
    owner plan (same owner hash) for the same model, W and semantics, including groups the builder
    re-bases at another tensor ([Note: shifts]); the re-basing moves the values with them."""
    policies = ("owner", "auto")
    runs = spawn_gloo(_owner_runs.engine_plans, world, args=(policies,), timeout=300)
    for policy in policies:
        want = _owner_runs.planned(world, policy)
        assert want["units"] and want["owner_hash"], policy  # auto computes the MLP matrices at owners
        for got in runs:
            res = got[policy]
            assert res["values_kept"], policy
            assert res["layouts"] == want["layouts"], policy
            assert res["units"] == want["units"] and res["owner_hash"] == want["owner_hash"], policy
    assert any(got[p]["shifted"] for got in runs for p in policies)  # the shifts ran, not only rotations


def test_stacked_experts_run_torch_muon_per_expert_matrix_bitwise_at_w2():
    """torch's Muon refuses 3-D tensors: OwnerComputeOptimizer gives it each expert's (m, n) matrix,
    whole-placed experts as views of the local piece and cut ones at their owners, and matches one
    process that runs torch's Muon on every expert's matrix."""
    want = run_single(_owner_runs.experts_reference, timeout=300)
    flattened = run_single(_owner_runs.experts_reference, args=(False,), timeout=300)
    assert _max_diff(flattened, want) > CONTROL_MIN  # control: Muon on the whole stack is another update
    policies = ("owner", "whole", "auto")
    runs = spawn_gloo(_owner_runs.experts_cases, 2, args=(policies,), timeout=300)
    _, m, n = _owner_runs.EXPERTS
    for policy in policies:
        for res in (r[policy] for r in runs):
            got = res["params"]
            bad = [k for k in want if not torch.equal(got[k], want[k])]
            assert not bad, f"{policy}: {bad} differ, max {_max_diff(got, want):.3e}"
            assert all(len(s) == 2 for s in res["inner_shapes"]), (policy, res["inner_shapes"])
    assert any(r["owner"]["expert_units"] == [m * n] for r in runs)  # under owner an expert is cut: at its owner
    assert all(r["whole"]["expert_units"] == [] for r in runs)


def test_plain_torch_optimizers_under_auto_are_exact_or_refuse():
    """Sharding with the default policy ("auto") and then plain torch optimizers: AdamW (element-wise)
    over the pieces is bitwise one process's; torch's Muon over a cut matrix's pieces raises on every
    rank that holds one, naming the fix or the shape, never computing on a piece silently."""
    want = run_single(_owner_runs.adamw_reference, timeout=300)
    for res in spawn_gloo(_owner_runs.plain_under_auto, 2, timeout=300):
        assert "0.0.weight" in res["owner"]  # auto computes the 96 x 40 matrix at an owner
        bad = [n for n in want if not torch.equal(res["params"][n], want[n])]
        assert not bad, f"{bad} differ, max {_max_diff(res['params'], want):.3e}"
        err = res.get("muon_error", "")
        assert "OwnerComputeOptimizer" in err or "Muon only supports 2D parameters" in err, err
