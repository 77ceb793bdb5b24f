"""The `blockshard` command line, run as a user runs it (a subprocess of the installed script)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from blockshard.cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blockshard", *args], capture_output=True, text=True, timeout=120)


def test_plan_json_has_the_promised_fields():
    out = run("plan", "--model", "llama3-8b", "--world-size", "1024", "--semantics", "bnb8bit", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    for key in ("world_size", "total_numel", "padding_fraction", "max_segment_over_lower_bound", "plan_seconds"):
        assert key in data
    assert data["world_size"] == 1024 and data["total_numel"] == 8_030_261_248
    assert set(data["baselines"]) == {"fsdp2", "zero3", "zero12", "naive"}
    for b in data["baselines"].values():
        assert set(b) >= {"padding_fraction", "splits_units"}
    # bnb8bit blocks: ZeRO-1/2's flat partitions split some, blockshard none and pads < 1%
    assert data["baselines"]["zero12"]["splits_units"] > 0
    assert data["padding_fraction"] < 0.01 and data["max_segment_over_lower_bound"] < 1.02


def test_plan_table_and_plot(tmp_path):
    png = tmp_path / "loads.png"
    out = run("plan", "--model", "mixtral-8x7b", "-W", "64", "--semantics", "muon", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    for word in ("group kind", "blockshard", "fsdp2", "zero12", "naive", "model.layers.*", "total"):
        assert word in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plan_reads_config_and_shapes_files(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 1000,
                "hidden_size": 64,
                "intermediate_size": 160,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            }
        )
    )
    out = run("plan", "--config", str(cfg), "-W", "3", "--semantics", "nf4", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["num_groups"] == 3
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"tensors": [{"name": "a.0.w", "shape": [6, 64]}, {"name": "b", "shape": [64]}]}))
    out = run("plan", "--shapes", str(shapes), "-W", "2", "--json", "--layouts")
    data = json.loads(out.stdout)
    assert [g["name"] for g in data["layouts"]] == ["a.0", ""]


def test_inspect_shows_a_rank(capsys):
    assert main(["inspect", "--model", "llama3-8b", "-W", "4", "--semantics", "muon", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank 1:" in out and "model.layers.0" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--model", "llama-9b", "-W", "8"], "llama3-8b"),  # unknown model lists the catalog
        (["plan", "--model", "llama3-8b", "-W", "0"], "--world-size=0 must be an integer >= 1"),
        (["plan", "--model", "llama3-8b", "--semantics", "nf5"], "unknown semantics 'nf5'"),
        (["plan", "--shapes", "/nonexistent.json"], "/nonexistent.json"),
        (["plan", "--model", "llama3-8b", "--semantics", "*embed*=nf4,*embed*=mx"], "two quantizer semantics"),
    ],
)
def test_bad_input_is_one_clear_error_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_demo_runs():
    """A short demo on 4 ranks with torch Muon on whole matrices (tests/test_demo.py runs the default)."""
    cmd = [sys.executable, "-m", "blockshard", "demo", "--world-size", "4", "--optimizer", "muon", "--steps", "3"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)  # 4 spawned ranks: slow on 2 loaded cores
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 3" in out.stdout and "3/3" in out.stdout and "FSDP2 Shard(0)" in out.stdout
    assert "PASS" in out.stdout and "all 21 parameters bitwise equal" in out.stdout
