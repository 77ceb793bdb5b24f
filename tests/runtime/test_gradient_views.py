"""Gradient views ([Note: gradient views] in blockshard/runtime/core/_grad_sync.py) on spawned gloo
ranks: with the views on, no training step copies a gradient into the reduce-scatter input, in every
configuration the engine trains in (``_views_runs.CASES``: no-sync micro-batches, bf16 compute
reduced in bf16 and bf16 micro-batches summed in fp32, partly frozen LoRA, freezing and
``requires_grad`` changes, activation checkpointing, CPU offload, trainable masters gathered
quantized, owner-computed Muon, HSDP), and training equals one process bitwise (every rank the
whole batch, W in {2, 4}: the average of identical gradients is exact).

The counter is ``benchmarks/engine_vs_fsdp2.py``'s ``OpCounter``, over the whole run: the bytes that
copy ops wrote on the engine's reduce-scatter path (``reduce_scatter_path``) and the casts there.
The control runs the same cases with the views off (gloo's default, ``BLOCKSHARD_GRADIENT_VIEWS=0``):
the counter then sees the copies (or, for bf16 micro-batches summed in fp32, the casts), and the
results are the same bits.
"""

from __future__ import annotations

import functools

import _views_runs as V
import pytest
import torch

from blockshard._launch import run_single, spawn_gloo

pytestmark = pytest.mark.slow

FLAT = tuple(c for c in V.CASES if c != "hsdp")  # hsdp needs a (2, 2) mesh: W = 4
MATRIX = [(2, c) for c in FLAT] + [(4, c) for c in (*FLAT, "hsdp")]


@functools.cache
def reference() -> dict:
    return run_single(V.references, args=(tuple(V.CASES),), timeout=600)


@functools.cache
def views(world: int, on: bool) -> list[dict]:
    cases = FLAT + (("hsdp",) if world == 4 else ())
    return spawn_gloo(V.counted, world, args=(cases, on), timeout=900)


def _diffs(got: dict, want: dict) -> dict[str, float]:
    assert got.keys() == want.keys()
    return {n: (got[n] - want[n]).abs().max().item() for n in want if not torch.equal(got[n], want[n])}


@pytest.mark.parametrize(("world", "case"), MATRIX)
def test_no_gradient_is_copied_and_training_equals_one_process_bitwise(world, case):
    want = reference()[case]
    for rank, res in enumerate(views(world, True)):
        got = res[case]
        assert got["rs_copy_bytes"] == 0, f"rank {rank}: {got['rs_copy_ops']}"
        assert got["rs_cast_bytes"] == 0, f"rank {rank}: {got['rs_cast_bytes']} bytes cast"
        assert not _diffs(got["params"], want), f"rank {rank}: {_diffs(got['params'], want)}"


@pytest.mark.parametrize("case", FLAT)
def test_control_without_views_the_counter_sees_the_copies(case):
    """The same runs with the views off copy every gradient in (a cast where it changes the dtype):
    the counter sees them, so its zero above is a measurement; and the bits are the same."""
    want = reference()[case]
    for rank, res in enumerate(views(2, False)):
        got = res[case]
        assert got["rs_copy_bytes"] + got["rs_cast_bytes"] > 0, f"rank {rank}: nothing counted"
        assert not _diffs(got["params"], want), f"rank {rank}: {_diffs(got['params'], want)}"
