"""Smoke test of ``benchmarks/muon_step.py``: the smallest run (W = 2, one small block, two timed steps)
produces a complete report, and what the full run's numbers rest on holds: every variant has a
positive step time (or, for plain Muon on DTensors, a recorded error), the ragged engine's step issues
no collective, the ragged ranks together orthogonalize every matrix exactly once, and the two
whole-matrix variants on stock FSDP2 train the same parameters as the ragged engine.
"""

from __future__ import annotations

import json
import pathlib

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_muon_step_smallest_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the spawned ranks import the module by this name
    import muon_step as bench

    out = tmp_path / "muon_step.json"
    argv = ["--world-size", "2", "--blocks", "1", "--hidden", "64", "--kv-dim", "32", "--intermediate", "176",
            "--heads", "2", "--seq-len", "8", "--batch-size", "1", "--steps", "2", "--warmup", "1",
            "--out", str(out)]  # fmt: skip
    report = bench.main(argv)

    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["command"] == "python benchmarks/muon_step.py " + " ".join(argv)
    assert report["world_size"] == 2 and report["model"]["num_matrices"] == 7
    vs = report["variants"]
    assert set(vs) == set(bench.VARIANTS)
    for name, v in vs.items():
        if v["status"] == "error":
            assert name == "fsdp2+plain-muon", (name, v["error"])
            assert v["error"]["type"] and v["error"]["message"]
            continue
        assert v["step_time_s"]["median"] > 0 and v["step_time_s"]["min"] > 0, name
        assert len(v["step_time_s"]["per_step_slowest_rank"]) == 2
        assert all(f > 0 for f in v["ns_flops_per_rank"]), name

    total = report["totals"]["ns_flops_total"]
    r, o, g = vs["ragged"], vs["fsdp2+owner"], vs["gather-everywhere"]
    # ragged: no communication in the step, every matrix orthogonalized once, by one rank.
    assert r["step_bytes_sent_per_rank"] == r["step_bytes_received_per_rank"] == [0, 0]
    assert r["step_collectives_rank0"] == {}
    assert r["ns_flops_sum_over_ranks"] == total
    assert r["matmul_flops_dispatched_per_rank"] == r["ns_flops_per_rank"]  # counted = from shapes
    assert r["planner_prediction_matches"]
    # owner-compute: the whole matrices too, once each; the bytes counted equal the owner plan's.
    assert o["ns_flops_sum_over_ranks"] == total
    assert o["step_bytes_sent_per_rank"] == o["step_bytes_planned_per_rank"]
    assert set(o["step_collectives_rank0"]) - {"header_allgather"} == {"alltoall_base_"}
    assert report["ratios"]["owner_step_bytes_max_rank_over_2x_grad_bytes_per_rank"] <= 1.0
    # gather-everywhere: every rank orthogonalizes every matrix.
    assert g["ns_flops_per_rank"] == [total, total]
    assert g["step_bytes_sent_per_rank"] == g["step_bytes_planned_per_rank"]
    # Same gradients on every rank (the whole batch), so the same Muon: bitwise equal parameters.
    assert o["param_max_abs_diff_vs_ragged"] == 0.0 and g["param_max_abs_diff_vs_ragged"] == 0.0
    # ragged+owner, both Muons: every matrix once, the bytes the exchange lists plan, bitwise equal.
    for name in ("ragged+owner", "ragged+owner (momentum-sharded)"):
        v = vs[name]
        assert v["ns_flops_sum_over_ranks"] == total, name
        assert v["step_bytes_sent_per_rank"] == v["step_bytes_planned_per_rank"], name
        assert set(v["step_collectives_rank0"]) <= {"alltoall_base_", "header_allgather"}, name
        assert v["param_max_abs_diff_vs_ragged"] == 0.0, name
    assert set(report["targets"]) == {"ragged_step_at_least_2x_faster_than_gather_everywhere",
                                      "ragged_ns_flops_max_rank_le_1.1x_total_over_W",
                                      "owner_step_bytes_max_rank_le_2x_grad_bytes_over_W",
                                      "ragged_owner_step_le_fsdp2_owner", "ragged_owner_step_le_0.3x_gather_everywhere",
                                      "momentum_sharded_step_le_fsdp2_owner",
                                      "momentum_sharded_step_le_0.3x_gather_everywhere"}  # fmt: skip
