"""Smoke test of ``benchmarks/engine_vs_fsdp2.py``: the smallest run (W = 2, one round, two timed steps,
the tiny Llama) produces a complete report, and the copy accounting says what was measured on the
full run: FSDP2 copies shards in before and out after every all-gather and copies gradients in before
every reduce-scatter; blockshard's engine copies nothing on the all-gather path (fp32, no mixed
precision) and copies gradients into the reduce-scatter input once, as FSDP2 does.
"""

from __future__ import annotations

import json
import pathlib

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
def test_engine_vs_fsdp2_smallest_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the spawned ranks import the module by this name
    import engine_vs_fsdp2 as bench

    out = tmp_path / "engine_vs_fsdp2.json"
    argv = ["--world-size", "2", "--rounds", "1", "--steps", "2", "--warmup", "1", "--model", "tiny-llama",
            "--out", str(out)]  # fmt: skip
    report = bench.main(argv)

    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["command"] == "python benchmarks/engine_vs_fsdp2.py " + " ".join(argv)
    assert report["world_size"] == 2 and report["model"]["preset"] == "tiny-llama"
    engines = report["engines"]
    assert set(engines) == {"fsdp2", "blockshard"}
    for e in engines.values():
        assert e["step_time_s"]["median"] > 0 and e["step_time_s"]["min"] > 0
        assert all(v > 0 for v in e["phase_median_s"].values())
        assert e["memory_bytes"]["peak"] >= e["memory_bytes"]["at_step_start"] > 0
    assert report["ratios"]["step_time"] > 0 and report["ratios"]["peak_memory"] > 0

    f, b = engines["fsdp2"], engines["blockshard"]
    # blockshard: the gathered buffer is the parameters (no copy-in, no copy-out); gradients are
    # packed into the reduce-scatter input once: the gradient bytes, never more than FSDP2's chunk_cat
    # (which also writes its padding).
    assert b["copy_bytes"]["all_gather_path"] == 0
    assert 0 < b["copy_bytes"]["reduce_scatter_path"] <= f["copy_bytes"]["reduce_scatter_path"]
    assert b["copy_bytes"]["engine_other"] == 0
    # FSDP2 copies every shard into the all-gather input: exactly the bytes the all-gathers send.
    f_ag = f["collectives_rank0"]["_allgather_base_"]
    assert f["copy_ops_rank0"]["all_gather_path"]["fsdp::all_gather_copy_in"]["bytes"] == f_ag["bytes_sent"] > 0
    assert f["copy_ops_rank0"]["all_gather_path"]["fsdp::split_with_sizes_copy"]["bytes"] > 0  # copy-out
    assert f["copy_ops_rank0"]["reduce_scatter_path"]["fsdp::chunk_cat"]["bytes"] > 0  # gradient copy-in
    assert f["grad_accumulate_add"]["bytes"] == b["grad_accumulate_add"]["bytes"] == 0
    # Same model, data and collectives per step, so the same training.
    for kind in ("_allgather_base_", "_reduce_scatter_base_"):
        assert f["collectives_rank0"][kind]["count"] == b["collectives_rank0"][kind]["count"] > 0
    # blockshard on gloo: one header before each of its collectives ([Note: collective headers])
    data = sum(c["count"] for k, c in b["collectives_rank0"].items() if k != "header_allgather")
    assert b["collectives_rank0"]["header_allgather"]["count"] == data, b["collectives_rank0"]
    assert "header_allgather" not in f["collectives_rank0"]
    assert report["loss_max_abs_diff"] < 1e-4


@pytest.mark.slow
def test_persistent_bytes_report(tmp_path, monkeypatch):
    """``--persistent``: FSDP2's bytes come from its own ``fully_shard`` over a fake process group and
    match its per-parameter ``ceil(dim0 / W) * rest`` padding; blockshard's come from the plan and are
    never above the even share by more than the alignment, nor above FSDP2's."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import engine_vs_fsdp2 as bench

    out = tmp_path / "persistent.json"
    argv = ["--persistent", "--world-size", "96", "--catalog", "llama3-8b", "--out", str(out)]
    report = bench.main(argv)

    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    (row,) = report["models"]
    assert row["model"] == "llama3-8b" and report["world_size"] == 96
    assert row["fsdp2_matches_formula"] is True
    # 96 divides the 128256-row embedding but not 4096, 1024 or 14336 rows: FSDP2 pads those.
    assert row["fsdp2_bytes_per_rank"] > row["ideal_bytes_per_rank"]
    assert row["ideal_bytes_per_rank"] <= row["blockshard_bytes_per_rank"] <= row["fsdp2_bytes_per_rank"]
    assert row["ratio_blockshard_over_fsdp2"] == row["blockshard_bytes_per_rank"] / row["fsdp2_bytes_per_rank"]
