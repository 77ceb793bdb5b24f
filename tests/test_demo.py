"""`blockshard demo` (what `make demo` runs), as a user runs it: a subprocess of `python -m blockshard`."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from blockshard.cli import main


def run_demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "blockshard", "demo", *args], capture_output=True, text=True, timeout=240
    )


@pytest.mark.slow
def test_demo_trains_on_two_ranks_bitwise_equal_to_one_process():
    out = run_demo()
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    # the plan: per group S, padding and what every rank holds, and the FSDP2 line
    for word in (
        "plan: tiny Llama",
        "model.layers.0: S = ",
        "model.layers.1: S = ",
        "root: S = ",
        "padding",
        "rank 0",
        "rank 1",
        "mlp.gate_proj",
        "model.embed_tokens",
        "whole",
        "FSDP2 Shard(0)",
        "(owner)",  # policy auto computes the MLP matrices at owners at W = 2 ...
        "-> owner rank",  # ... and the plan names the owner of every cut matrix before training
        "OwnerComputeOptimizer",
    ):
        assert word in text, word
    # the progress bars end full, and the per-step losses of all 30 steps are printed
    assert "30/30" in text
    table = text[text.index("loss per step") : text.index("parameters after training")]
    losses = [float(x) for x in re.findall(r"\b\d+\.\d{6}\b", table)]
    assert len(losses) == 30 and losses[-1] < losses[0] - 1.0  # it learns
    assert "loss at every step identical to one process" in text
    assert "engine built the planned layouts" in text and "saw the planned block shapes" in text
    assert "planned layouts and owner plan (same hashes)" in text
    verdict = next(line for line in text.splitlines() if line.startswith(("PASS", "FAIL")))
    assert verdict.startswith("PASS") and "bitwise equal" in verdict and "NOT" not in verdict
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_demo_control_fails_when_muon_runs_on_split_matrices():
    """The check can fail: element-wise shards cut hidden matrices, so Muon computes something else."""
    out = run_demo("--semantics", "elementwise", "--optimizer", "muon", "--steps", "3")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL" in out.stdout and "NOT bitwise equal" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["demo", "--steps", "0"], "steps=0 must be an integer >= 1"),
        (["demo", "-W", "1"], "world_size=1 must be an integer >= 2"),
        (["demo", "--semantics", "nf5"], "unknown semantics 'nf5'"),
        (["demo", "-W", "1000"], "world_size=1000 must be at most 8 (the demo spawns one process per rank"),
        (["demo", "-W", "-3"], "world_size=-3 must be an integer >= 2"),
        (["demo", "--steps", "-1"], "steps=-1 must be an integer >= 1"),
        (["demo", "--steps", "100000"], "steps=100000 must be at most 10000; pass 1 to 10000"),
    ],
)
def test_demo_bad_input_is_one_clear_error_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_importing_the_cli_stays_light():
    code = (
        "import sys, blockshard.cli, blockshard._demo; "
        "print(sorted({'torch', 'transformers', 'rich'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
