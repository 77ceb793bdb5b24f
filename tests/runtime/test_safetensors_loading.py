"""``blockshard.load_safetensors`` ([Note: sharded loading] in blockshard/runtime/checkpoint/_safetensors.py)
on spawned gloo ranks: a tiny HF Llama saved by ``save_pretrained`` in several safetensors files,
built on the meta device, sharded per layer at W = 2, materialized and loaded, equals the model
``from_pretrained`` loads, bitwise (tied and untied head); each rank reads exactly its pieces."""

from __future__ import annotations

import os

import _safetensors_runs
import pytest
import torch

from blockshard._launch import run_single, spawn_gloo

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tie", [False, True])
def test_sharded_loading_equals_from_pretrained_and_reads_only_the_pieces(tmp_path, tie):
    want = run_single(_safetensors_runs.save, args=(str(tmp_path), tie), timeout=120)
    files = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(files) > 1 and "model.safetensors.index.json" in os.listdir(tmp_path)
    got = spawn_gloo(_safetensors_runs.load, 2, args=(str(tmp_path), tie), timeout=240)
    for rank, r in enumerate(got):
        assert r["state"].keys() == want["state"].keys()
        for k, v in want["state"].items():
            assert torch.equal(r["state"][k], v), (rank, k)
        assert torch.equal(r["logits"], want["logits"]), rank
        assert r["read_bytes"] == r["held_bytes"] < 0.6 * r["model_bytes"], rank  # its own pieces only
    assert sum(r["held_bytes"] for r in got) >= 0.99 * got[0]["model_bytes"]
