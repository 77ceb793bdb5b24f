"""Blockwise FP8 (128 x 128 tiles) frozen weights sharded by whole 128-row tile stripes with their
scales, or (``tile_placement=True``) by whole tiles in tile-major order (threaded gloo ranks), and
why the cut must follow the tiles.

Three ``FP8Linear``-shaped layers (rows 192, 320, 256: tail stripes in both dims) with bf16 adapters:
with the whole batch on every rank, logits, first-step adapter gradients and adapters after two
AdamW steps equal one process bitwise at W in {2, 4}; at W = 3 logits bitwise, gradients within
one bf16 ulp; the same under tile placement, whose segments are smaller at W >= 3 (the control). Quantizing each rank's whole stripes locally and gathering gives the bytes of
quantizing the whole weight (bitwise); the control cuts at torch.chunk's rows (FSDP2's Shard(0)).
"""

from __future__ import annotations

import functools
import itertools

import _fp8_runs
import _inproc
import pytest
import torch
from _adapters import check_equal_one_process

import blockshard
from blockshard import QuantizedWeightError

pytestmark = pytest.mark.timeout(300)


@functools.cache
def reference() -> dict:
    with _inproc.single_thread():
        return _fp8_runs.train(0, 0)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fp8_block_weights_equal_one_process(world):
    want = reference()
    results = _inproc.run_ranks(_fp8_runs.train, world)
    check_equal_one_process(results, want, world)
    for got in results:
        for pieces in got["pieces"]:  # every piece: whole 128-row stripes (the tensor's tail stripe last)
            assert all(stop > start for start, stop in pieces)
    # tile placement ([Note: tile placement in the engine]): whole tiles, the same numbers
    tiles = _inproc.run_ranks(_fp8_runs.train, world, args=(2, True))
    check_equal_one_process(tiles, want, world)
    stripes_total = sum(len(pieces) for got in results for pieces in got["pieces"])
    assert stripes_total and all(stop > start for got in tiles for ps in got["pieces"] for start, stop in ps)
    # the control: at W >= 3 the stripes (2-3 per weight) pad each segment to a whole stripe, the tiles to one tile
    if world >= 3:
        assert tiles[0]["segment_bytes"] < results[0]["segment_bytes"], (tiles[0], results[0])
    # tile_placement="auto": per group the placement that pads less (tests/quantized/test_fast_plan_bytes.py
    # checks which), the same numbers
    auto = _inproc.run_ranks(_fp8_runs.train, world, args=(2, "auto"))
    check_equal_one_process(auto, want, world)
    assert auto[0]["segment_bytes"] <= min(tiles[0]["segment_bytes"], results[0]["segment_bytes"])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_stacked_fp8_experts_equal_one_process_by_stripes_and_by_tiles(world):
    """Stacked frozen FP8 experts shaped like GPT-OSS's scaled down ((4, 180, 360) and (4, 360, 180)
    in 32 x 32 tiles: 5 full tile rows and a 20-row edge, 11 full tile columns and an 8-column edge
    per expert) train as one process by stripes (rows no multiple of 32: one expert per unit, as the
    planner's grid) and by tiles (each expert's short edge tiles). The control: at W = 3 (four
    experts on three ranks) whole experts pad a segment to an expert, the tiles to one tile; at
    W = 2 and 4 the experts divide evenly and stripes pad no more."""
    with _inproc.single_thread():
        want = _fp8_runs.train_experts(0, 0)
    stripes = _inproc.run_ranks(_fp8_runs.train_experts, world)
    check_equal_one_process(stripes, want, world)
    tiles = _inproc.run_ranks(_fp8_runs.train_experts, world, args=(2, True))
    check_equal_one_process(tiles, want, world)
    if world == 3:
        assert tiles[0]["segment_bytes"] < stripes[0]["segment_bytes"], (tiles[0], stripes[0])


def _quantize_pieces(w: torch.Tensor, cuts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [_fp8_runs.quantize_fp8_block(w[a:b]) for a, b in itertools.pairwise(cuts)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_local_quantization_of_whole_stripes_equals_gather_then_quantize(world):
    w = torch.randn(320, 192, generator=torch.Generator().manual_seed(1))
    q, s = _fp8_runs.quantize_fp8_block(w)
    stripes = [0, 128, 256, 320]  # blockshard's cuts fall on stripe boundaries
    for cut in range(1, len(stripes) - 1):
        got_q, got_s = _quantize_pieces(w, [0, stripes[cut], 320])
        assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got_s, s)
    # control: torch.chunk's rows (FSDP2's Shard(0)) cut tiles, so each rank's scales differ
    rows = [c.shape[0] for c in torch.chunk(w, world)]
    cuts = [0, *torch.tensor(rows).cumsum(0).tolist()]
    assert any(c % 128 for c in cuts[1:-1])
    bad_q, bad_s = _quantize_pieces(w, cuts)
    assert bad_s.shape != s.shape or not torch.equal(bad_q.view(torch.uint8), q.view(torch.uint8))


def _one_rank(rank, world, tamper):
    layer = _fp8_runs.FP8BlockLinear(192, 320)
    tamper(layer)
    try:
        blockshard.fully_shard(layer)
    except QuantizedWeightError as e:
        return str(e)
    return ""


def test_scales_that_do_not_fit_the_tiles():
    def tamper(layer):
        layer.weight_scale_inv = torch.nn.Parameter(layer.weight_scale_inv[:2], requires_grad=False)

    msg = _inproc.run_ranks(_one_rank, 1, args=(tamper,))[0]
    assert "'weight' (blockwise FP8): its weight_scale_inv has shape (2, 2)" in msg
    assert "320 x 192 in 128 x 128 tiles needs (3, 2) fp32 scales" in msg and "Fix: re-quantize" in msg


def test_a_4d_weight_or_a_trainable_one_is_refused_by_name():
    def four_d(layer):
        layer.weight = torch.nn.Parameter(layer.weight.view(2, 160, 12, 16), requires_grad=False)

    msg = _inproc.run_ranks(_one_rank, 1, args=(four_d,))[0]
    assert "'weight' (blockwise FP8): it has shape (2, 160, 12, 16)" in msg and "stacked (experts, rows, cols)" in msg

    def stacked_scales(layer):  # a stacked expert weight with a 2-D scale grid
        layer.weight = torch.nn.Parameter(layer.weight.view(2, 160, 192), requires_grad=False)

    msg = _inproc.run_ranks(_one_rank, 1, args=(stacked_scales,))[0]
    assert "2 x 160 x 192 in 128 x 128 tiles needs (2, 2, 2) fp32 scales" in msg


def test_a_per_tensor_scale_has_no_tiles():
    def tamper(layer):
        layer.block_size = None

    msg = _inproc.run_ranks(_one_rank, 1, args=(tamper,))[0]
    assert "block_size=None is not a tile" in msg and "ignored_params" in msg


def _tile_placement_of(rank, world, value):
    try:
        blockshard.fully_shard(_fp8_runs.FP8BlockLinear(192, 320), tile_placement=value)
    except ValueError as e:
        return str(e)
    return ""


def test_tile_placement_takes_a_bool_or_auto():
    msg = _inproc.run_ranks(_tile_placement_of, 1, args=("yes",))[0]
    assert "tile_placement='yes' must be True, False or 'auto'" in msg
