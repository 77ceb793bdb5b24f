"""Smoke test of ``benchmarks/muon_tp.py``: the smallest run (tp 2, one small block, two timed steps)
produces a complete report, and what its numbers rest on holds: both ways train the same parameters
(Newton-Schulz of the global matrix either way), blockshard's owners issue two all-to-alls over tp per
step where the baseline all-gathers every matrix (7 per block), and both step times are positive."""

from __future__ import annotations

import json
import pathlib

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_muon_tp_smallest_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the spawned ranks import the module by this name
    import muon_tp as bench

    out = tmp_path / "muon_tp.json"
    argv = ["--tp", "2", "--blocks", "1", "--hidden", "32", "--intermediate", "64", "--steps", "2", "--warmup", "1",
            "--out", str(out)]  # fmt: skip
    report = bench.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["command"] == "python benchmarks/muon_tp.py " + " ".join(argv)
    assert report["max_param_diff"] == 0.0
    ways = report["ways"]
    assert ways["owners"]["tp_calls_per_rank"] == 2 and ways["every_rank"]["tp_calls_per_rank"] == 7
    assert {c["kind"] for c in ways["owners"]["collectives_rank0"]} == {"all-to-all"}
    assert {c["kind"] for c in ways["every_rank"]["collectives_rank0"]} == {"all-gather"}
    for w in bench.WAYS:
        assert ways[w]["step_time_s"]["median"] > 0 and ways[w]["tp_bytes_per_rank"] > 0, w
    assert report["ratios"]["owners_over_every_rank_step_time"] > 0
