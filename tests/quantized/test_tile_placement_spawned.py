"""Frozen blockwise-FP8 weights placed by whole tiles ([Note: tile placement in the engine]) on
spawned gloo ranks: training equals one process (W in {2, 3, 4}; at W = 3 the adapter gradients
within one bf16 ulp, as every frozen-quantized run: ``_adapters.check_equal_one_process``), and a
checkpoint saved tile-placed at W = 4 loads at W = 2, into tiles and into stripes; stacked
GPT-OSS-shaped experts with short edge tiles train as one process at W = 3 and 4.
Controls: stripes at the same W hold larger segments (W >= 3); overwritten segments differ before
the load. The threaded tier (test_fast_fp8_block.py, test_fast_quantized_state_dicts.py) runs more
moves between placements and world sizes."""

from __future__ import annotations

import functools

import _fp8_runs
import _state_runs
import pytest
from _adapters import check_equal_one_process

from blockshard._launch import run_single, spawn_gloo

pytestmark = pytest.mark.slow


@functools.cache
def reference(experts: bool = False) -> dict:
    return run_single(_fp8_runs.run, args=(False, False, experts), timeout=300)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_tile_placed_fp8_equals_one_process(world):
    want = reference()
    tiles = spawn_gloo(_fp8_runs.run, world, args=(True, True), timeout=300)
    check_equal_one_process(tiles, want, world)
    if world >= 3:  # the control: the stripes' segments are larger
        stripes = spawn_gloo(_fp8_runs.run, world, args=(True, False), timeout=300)
        assert tiles[0]["segment_bytes"] < stripes[0]["segment_bytes"]


@pytest.mark.parametrize("world", [3, 4])
def test_tile_placed_stacked_fp8_experts_equal_one_process(world):
    """GPT-OSS-shaped stacked experts scaled down ((4, 180, 360) in 32 x 32 tiles: a 20-row and an
    8-column edge per expert) by tiles; the control at W = 3: whole experts pad more."""
    want = reference(experts=True)
    tiles = spawn_gloo(_fp8_runs.run, world, args=(True, True, True), timeout=300)
    check_equal_one_process(tiles, want, world)
    if world == 3:
        stripes = spawn_gloo(_fp8_runs.run, world, args=(True, False, True), timeout=300)
        assert tiles[0]["segment_bytes"] < stripes[0]["segment_bytes"]


@pytest.mark.parametrize("load_kind", ["fp8_tiles", "fp8"])
def test_saved_tile_placed_at_w4_loads_at_w2(load_kind, tmp_path):
    path = str(tmp_path / "ckpt")
    spawn_gloo(_state_runs.spawned, 4, args=("save", "fp8_tiles", path, False, ()), timeout=300)
    for out in spawn_gloo(_state_runs.spawned, 2, args=("load", load_kind, path, False, ()), timeout=300):
        assert out["corrupted_differs"]
        assert out["after_load"] == []
