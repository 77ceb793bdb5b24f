"""Smoke test of ``benchmarks/quantized_gather.py``: the smallest run (W = 2, one small layer) gives a
complete report, and what the full run's numbers rest on holds: the 4-bit base gathers its physical
bytes (0.258 x bf16 nested, 0.281 x bf16 with fp32 absmax), the replicated path gathers none of them
and holds everything on every rank, and blockshard's ranks hold about total / W; blockwise FP8
(stripes and tiles) holds every byte once, and at this size the tiles pad no more than the stripes
(in general the nearest-boundary cut of either may pad less by a unit); trainable FP8 masters gathered
quantized (stripes and packed tiles) gather at least their physical bytes, about half of bf16.
"""

from __future__ import annotations

import json
import pathlib

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quantized_gather_smallest_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the spawned ranks import the module by this name
    import quantized_gather as bench

    out = tmp_path / "quantized_gather.json"
    argv = ["--world-size", "2", "--hidden-size", "128", "--intermediate-size", "352", "--num-hidden-layers", "1",
            "--num-attention-heads", "4", "--num-key-value-heads", "2", "--out", str(out)]  # fmt: skip
    report = bench.main(argv)

    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["command"] == "python benchmarks/quantized_gather.py " + " ".join(argv)
    assert set(report["variants"]) == set(bench.VARIANTS)
    r, v = report["ratios"], report["variants"]
    assert 0.25 <= r["blockshard-4bit-nested_gathered_over_bf16"] <= 0.27
    assert 0.28 <= r["blockshard-4bit_gathered_over_bf16"] <= 0.29
    assert v["replicated-4bit"]["base_gathered_bytes_per_step"] == 0
    for name in ("blockshard-4bit-nested", "blockshard-4bit"):
        ranks = v[name]["per_rank"]
        assert sum(x["quantized_bytes"] for x in ranks) == ranks[0]["quantized_total_bytes"]  # nothing replicated
        assert r[f"{name}_persistent_max_rank_over_total_over_W"] <= 1.05
        assert r[f"replicated_persistent_over_{name}_persistent"] > 1.8
    assert all(report["targets"].values())
    # blockwise FP8: every byte held once, gathered with its padding
    for name in ("blockshard-fp8-stripes", "blockshard-fp8-tiles"):
        ranks = v[name]["per_rank"]
        assert sum(x["quantized_bytes"] for x in ranks) == ranks[0]["quantized_total_bytes"]
        assert 0.49 <= r[f"{name}_gathered_over_bf16"] <= 0.6  # 1 byte + 4 per 16384 values, plus padding
        assert r[f"{name}_gathered_over_physical"] >= 1.0
    assert r["fp8_tiles_persistent_over_stripes"] <= 1.0 and r["fp8_tiles_gathered_over_stripes"] <= 1.0
    # trainable FP8 masters gathered quantized: the physical bytes at least, and the masters' bf16
    # pieces over their unpadded share (tiles: within their slots' zeros; 352 = 2.75 x 128 rows)
    for name in bench.MASTERS:
        assert r[f"{name}_gathered_over_physical"] >= 1.0
        assert 0.49 <= r[f"{name}_gathered_over_bf16"] <= 0.6
        assert r[f"{name}_masters_max_rank_over_share"] >= 1.0
        ranks = v[name]["per_rank"]  # every master value held once (plus padding)
        assert len(ranks) * ranks[0]["master_bytes"] >= ranks[0]["master_real_bytes"]
