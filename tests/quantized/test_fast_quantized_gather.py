"""Trainable weights gathered quantized (``quantized_gather=True``, [Note: quantized gather]): MX
(MXFP8, MXFP4; torchao, 1 x 32) and blockwise FP8 (128 x 128; 64 x 64 per expert) with fp32 masters.

* Each rank quantizes its own whole tiles: the gathered payload and scales equal quantizing the
  whole master weight (torchao's ``to_mx``; the pure-torch FP8 reference of ``_fp8_runs.py``),
  bitwise at W = 1, 2, 3, 4, and the unsharded weight is its dequantization in the param dtype
  (fp32; bf16 under ``mp_policy``). The all-gather moves the quantized bytes only (1 byte per
  value, MXFP4 half, plus scales): counted at the engine's collectives.
* Training (forward, backward, AdamW) with the whole batch on every rank equals one process with a
  straight-through fake quantization by the reference quantizers, bitwise at W = 1, 2, 4 (at W = 3
  the average of three identical gradients is off by an ulp, which a quantizer may round to
  another code: not compared). Quantization runs once per step: in ``precompute_quantized_gather``
  after the step, or, when it was not called, at the next forward's unshard, never in backward.
* Control: quantizing the pieces of an element-wise cut (or FSDP2's ``torch.chunk`` rows for FP8)
  gives other scales and bytes.
"""

from __future__ import annotations

import functools
import itertools

import _fp8_runs
import _inproc
import _qgather_runs as R
import pytest
import torch

import blockshard
from blockshard import QuantizedWeightError
from blockshard.runtime import ShardingError

pytestmark = pytest.mark.timeout(120)

SPECS = {f"layers.{k}.weight": spec for k, (_, _, spec) in enumerate(R.LAYERS)} | {
    f"experts.{k}": e[3] for k, e in enumerate(R.EXPERTS)
}


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize(
    ("world", "dtype"), [(2, None), (1, None), (3, None), (4, None), (2, torch.bfloat16), (3, torch.bfloat16)]
)
def test_gathered_weights_equal_quantizing_the_whole_weight(world, dtype, monkeypatch):
    counter = R.ByteCount(monkeypatch)
    results = _inproc.run_ranks(R.gathered, world, args=(counter, dtype))
    for rank, got in enumerate(results):
        assert set(got["payload"]) == set(SPECS)
        for name, spec in SPECS.items():
            master = got["masters"][name]
            want_q, want_s = R.reference_quantize(master, spec)
            q, s = got["payload"][name]
            assert q.shape == want_q.shape and s.shape == want_s.shape, (rank, name)
            assert torch.equal(_bytes_of(q), _bytes_of(want_q)) and torch.equal(_bytes_of(s), _bytes_of(want_s))
            want = R.reference_fake_quant(master, spec, dtype or master.dtype)
            assert torch.equal(got["unsharded"][name], want), (rank, name)
        for k, (i, o, spec) in enumerate(R.LAYERS):
            stats, moved = got["stats"][f"layers.{k}"], got["bytes"][k]
            bits = 4 if spec == "mx:4" else 8
            scales = i * o // 32 if spec.startswith("mx") else 4 * -(-o // 128) * -(-i // 128)
            assert stats.total_bytes == i * o * bits // 8 + scales
            assert moved["quantized"] == stats.gathered_bytes == world * stats.local_bytes
            assert moved["float"] <= world * 4 * (o + 16)  # the bias only: the weight moves quantized
            # every rank's segment: its tiles' bytes plus at most 2 x 16 alignment bytes
            assert stats.local_bytes <= max(_rank_bytes(i, o, spec, world)) + 32


def _rank_bytes(i: int, o: int, spec: str, world: int) -> list[int]:
    """Payload and scale bytes each rank holds under the tile-aligned layout (tile units from the semantics)."""
    from blockshard.planner import resolve_items
    from blockshard.planner._lay_out import plan_group
    from blockshard.semantics import TensorSpec

    items = resolve_items([TensorSpec(name="w", shape=(o, i), dtype="float32")], {"w": spec})
    layout = plan_group(items, world)
    bits, out = (4 if spec == "mx:4" else 8), []
    for r in range(world):
        n = layout.rank_numel(r)
        scales = n // 32 if spec.startswith("mx") else 4 * (n // i // 128 + bool(n // i % 128)) * -(-i // 128)
        out.append(n * bits // 8 + scales)
    return out


@functools.cache
def _one_process() -> dict:
    with _inproc.single_thread():
        return R.train(0, 0)


@pytest.mark.parametrize("world", [2, 1, 4])
def test_training_equals_one_process_with_fake_quantization(world):
    want = _one_process()
    for rank, got in enumerate(_inproc.run_ranks(R.train, world)):
        for step, (y, w) in enumerate(zip(got["logits"], want["logits"], strict=True)):
            assert torch.equal(y, w), (rank, step)
        assert got["params"].keys() == want["params"].keys()
        for name, p in want["params"].items():
            assert torch.equal(got["params"][name], p), (rank, name)
        # step 0: the first unshard and the precompute; step 1: precomputed, nothing in the hooks;
        # step 2: no precompute after step 1, so its forward quantized, then the precompute
        assert got["quantizations"] == [[2] * 4, [2] * 4, [4] * 4], rank


def _elementwise_pieces(w: torch.Tensor, world: int) -> list[tuple[int, int]]:
    from blockshard.planner import resolve_items
    from blockshard.planner._lay_out import plan_group
    from blockshard.semantics import TensorSpec

    items = resolve_items([TensorSpec(name="w", shape=tuple(w.shape), dtype="float32")], "elementwise")
    layout = plan_group(items, world)
    return [(p.start, p.start + p.numel) for r in range(world) for p in layout.pieces(r)]


def test_control_quantizing_the_pieces_of_a_cut_through_tiles():
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    w = torch.randn(96, 320, generator=torch.Generator().manual_seed(0))
    whole = MXTensor.to_mx(w, torch.float8_e4m3fn, block_size=32)
    cuts = _elementwise_pieces(w, 7)  # an element-wise layout: 4392-value pieces, not whole 32-blocks
    assert any(a % 32 for a, _ in cuts[1:])
    qs = []
    for a, b in cuts:  # each rank quantizes its own piece (padded to whole blocks of its own)
        piece = torch.nn.functional.pad(w.reshape(-1)[a:b], (0, -(b - a) % 32))
        mx = MXTensor.to_mx(piece.reshape(-1, 32), torch.float8_e4m3fn, block_size=32)
        qs.append(mx.dequantize(torch.float32).reshape(-1)[: b - a])
    assert not torch.equal(torch.cat(qs), whole.dequantize(torch.float32).reshape(-1))
    # blockwise FP8 under FSDP2's Shard(0) rows (107, 107, 106): tiles straddle ranks
    v = torch.randn(320, 192, generator=torch.Generator().manual_seed(1))
    q, s = _fp8_runs.quantize_fp8_block(v)
    rows = [0, *itertools.accumulate(c.shape[0] for c in torch.chunk(v, 3))]
    parts = [_fp8_runs.quantize_fp8_block(v[a:b]) for a, b in itertools.pairwise(rows)]
    got_q, got_s = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    assert not torch.equal(got_s, s) and not torch.equal(_bytes_of(got_q), _bytes_of(q))


def test_the_payload_plan_refuses_a_layout_that_cuts_tiles():
    from blockshard.planner import resolve_items
    from blockshard.planner._lay_out import plan_group
    from blockshard.runtime.core._param import ShardedParam
    from blockshard.runtime.quantized._gather import plan_payload
    from blockshard.runtime.quantized._tile_quant import MXQuantizer
    from blockshard.semantics import TensorSpec

    layout = plan_group(resolve_items([TensorSpec(name="w", shape=(96, 320), dtype="float32")], "elementwise"), 7)
    sp = ShardedParam(fqn="w", refs=[], shape=(96, 320), requires_grad=True, index=0)
    with pytest.raises(QuantizedWeightError, match=r"'w' \(shape \(96, 320\), MX \(MXFP8 e4m3, 1 x 32\)\) in group"):
        plan_payload("g", layout, [sp], lambda _: MXQuantizer("w", (96, 320)))


def test_a_changed_master_is_quantized_again(gloo_w1):
    """An in-place change of a piece (load_state_dict, an optimizer) moves the version counter: the
    next unshard quantizes again without precompute. An edit through ``p.data`` does not: the
    precompute call takes it in."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 256)
    blockshard.fully_shard(layer, semantics={"weight": "fp8_block:128"}, quantized_gather=True)

    def unsharded() -> torch.Tensor:
        layer.unshard()
        w = layer.weight.detach().clone()
        layer.reshard()
        return w

    def want() -> torch.Tensor:
        master = blockshard.full_state_dict(layer)["weight"]
        return R.reference_fake_quant(master, "fp8_block:128", torch.float32)

    assert torch.equal(unsharded(), want())
    full = blockshard.full_state_dict(layer)
    layer.load_state_dict({**full, "weight": full["weight"] * 3})
    assert torch.equal(unsharded(), want())
    piece = next(p for n, p in layer.named_parameters() if n == "weight")
    piece.data.mul_(0.5)  # not seen by the version counter
    assert not torch.equal(unsharded(), want())
    assert blockshard.precompute_quantized_gather(layer) == 1
    assert torch.equal(unsharded(), want())


def _shard_error(module: torch.nn.Module, **kw) -> str:
    with pytest.raises((QuantizedWeightError, ShardingError)) as info:
        blockshard.fully_shard(module, **kw)
    return str(info.value)


def test_bad_input(gloo_w1):
    msg = _shard_error(torch.nn.Linear(48, 64), semantics={"weight": "mx"}, quantized_gather=True)
    assert "quantized gather of 'weight'" in msg and "last dim is not a multiple of the MX block of 32" in msg
    msg = _shard_error(torch.nn.Linear(64, 64), semantics={"*": "fp8_block:128"}, quantized_gather=True)
    assert "'bias'" in msg and "shape (64,): blockwise FP8 tiles non-empty 2-D weights" in msg
    two = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    two[1].to(torch.bfloat16)
    msg = _shard_error(two, semantics={"*.weight": "mx"}, quantized_gather=True)
    assert "several dtypes ('0.weight' (float32), '1.weight' (bfloat16))" in msg and "Fix: cast them" in msg
    table = torch.nn.Module()
    table.weight = torch.nn.Parameter(torch.zeros(4, 64, dtype=torch.int8), requires_grad=False)
    msg = _shard_error(table, semantics={"weight": "mx"}, quantized_gather=True)
    assert "'weight': its dtype is int8; quantized gather quantizes floating-point master weights" in msg
    msg = _shard_error(torch.nn.Linear(64, 64), semantics={"weight": "mx"}, quantized_gather="yes")
    assert "quantized_gather='yes' must be True or False" in msg
    msg = _shard_error(torch.nn.Linear(64, 64), semantics="muon", quantized_gather=True)  # it would do nothing
    assert "gives none of its parameters (nor of the groups sharded below it) a tile quantizer" in msg
    root = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.LayerNorm(64))
    blockshard.fully_shard(root[0], semantics={"weight": "fp8_block:128"}, quantized_gather=True)
    blockshard.fully_shard(root, semantics={"0.weight": "fp8_block:128"}, quantized_gather=True)  # a root: fine


@pytest.mark.heavy  # in process, seconds: out of `make test-fast` (its one-minute budget)
def test_accumulation_clipping_and_a_checkpoint_into_a_list_group(tmp_path):
    """Micro-batches without sync, the global ``clip_grad_norm_`` norm and an AdamW step equal one process
    (the norm within float rounding: its summation order differs); a checkpoint with the optimizer
    loads into a model whose layers 1 and 2 are one list group (another layout) and computes the same."""
    with _inproc.single_thread():
        want = R.accumulate_clip_checkpoint(0, 0)
    for got in _inproc.run_ranks(R.accumulate_clip_checkpoint, 2, args=(str(tmp_path / "ckpt"),)):
        torch.testing.assert_close(got["norm"], want["norm"], rtol=1e-6, atol=0)
        assert torch.equal(got["logits"], want["logits"])
        assert torch.equal(got["loaded"], want["logits"])
        assert got["names"] == [*(f"experts.{k}" for k in range(2)), *(f"layers.{k}.weight" for k in range(4))]
