"""Smoke test of ``benchmarks/drift.py``: the smallest run (AdamW, W = 2 and 3, two steps) gives
a complete report whose numbers are what the full run's rest on: 0 at W = 2 (the exact average), above
0 at W = 3 (the control: the measure does see the ulps of a three-rank average), one difference per
step, and the command that reproduces it."""

from __future__ import annotations

import json
import pathlib

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_drift_smallest_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the spawned ranks import the module by this name
    import drift as bench

    out = tmp_path / "drift.json"
    argv = ["--worlds", "2,3", "--steps", "2", "--optimizers", "adamw", "--out", str(out)]
    report = bench.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["command"] == "python benchmarks/drift.py " + " ".join(argv)
    runs = {(r["optimizer"], r["world_size"]): r for r in report["runs"]}
    assert sorted(runs) == [("adamw", 2), ("adamw", 3)]
    for (_, world), r in runs.items():
        assert len(r["max_abs_diff"]) == 2
        if world == 2:
            assert r["max_abs_diff"] == [0.0, 0.0] and r["first_step_above_1e-6"] is None
    assert max(runs[("adamw", 3)]["max_abs_diff"]) > 0.0  # measured 3.7e-9 after one step
