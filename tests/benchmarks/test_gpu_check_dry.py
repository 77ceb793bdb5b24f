"""``benchmarks/gpu_check.sh`` without GPUs: its dry check (2 CPU ranks over gloo under torchrun,
the real launcher) runs and reports blockshard bitwise equal to one process, as on GPUs it would
report NCCL's numbers. Marked slow (about 15 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "dry check on 2 CPU ranks" in proc.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["ok"] and report["backend"] == "gloo" and report["world_size"] == 2
    assert report["blockshard"]["max_abs_diff_from_one_process"] == 0.0
    assert report["blockshard-no-views"]["max_abs_diff_from_one_process"] == 0.0
    assert report["fsdp2"]["max_abs_diff_from_one_process"] == 0.0
    assert report["ratios"]["step_time"] > 0
