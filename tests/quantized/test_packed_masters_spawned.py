"""Trainable blockwise-FP8 masters in packed tile order ([Note: packed tile order in the engine]) on
spawned gloo ranks, with the GPT-OSS-shaped model of ``_packed_runs`` (stacked experts (4, 180, 352)
and (4, 360, 180) in 32 x 32 tiles: a 20-row edge per expert; a (200, 360) projection).

* AdamW training equals one process with a straight-through fake quantization, bitwise at W = 2
  and 4. At W = 3 the average of three identical gradients is off by an ulp, which AdamW carries
  into the masters and a quantizer may round to another FP8 code: the parameters and logits within
  the tolerance below (a code apart at most on a few values), the gathered bytes bitwise (the
  threaded tier, test_fast_packed_masters.py).
* A DCP checkpoint saved at W = 4 after two steps loads at W = 2 and the third step is bitwise the
  one process's.
* The controls run threaded (test_fast_packed_masters.py): stripes at W = 3 hold more per rank (the
  engine's layouts are the planner's), and more still at larger W (the planner's figures).
"""

from __future__ import annotations

import functools

import _packed_runs as P
import pytest
import torch

from blockshard._launch import run_single, spawn_gloo

pytestmark = pytest.mark.slow

# W = 3: one fp32 ulp in the averaged gradient, carried through 3 AdamW steps and the fake
# quantization (one FP8 E4M3 code is 1/8 of its binade: up to 6.25% of a value), reaches the logits
# through the few weights whose code flips
W3_RTOL, W3_ATOL = 1e-3, 1e-4


@functools.cache
def reference(steps: int = 3) -> dict:
    return run_single(P.one_process, args=(steps,), timeout=300)


def _close(got: dict, want: dict, exact: bool) -> None:
    def check(a: torch.Tensor, b: torch.Tensor, what: object) -> None:
        if exact:
            assert torch.equal(a, b), what
        else:
            torch.testing.assert_close(a, b, rtol=W3_RTOL, atol=W3_ATOL, msg=lambda m: f"{what}: {m}")

    for step, (y, w) in enumerate(zip(got["logits"], want["logits"], strict=True)):
        check(y, w, ("logits", step))
    assert got["params"].keys() == want["params"].keys()
    for name, p in want["params"].items():
        check(got["params"][name], p, name)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_packed_masters_train_as_one_process(world):
    want = reference()
    for got in spawn_gloo(P.train, world, timeout=300):
        _close(got, want, exact=world != 3)


def test_dcp_saved_at_w4_loads_at_w2_and_continues_bitwise(tmp_path):
    path = str(tmp_path / "ckpt")
    want = reference()
    saved = spawn_gloo(P.save_then_resume, 4, args=(path, "save"), timeout=300)
    assert all(torch.equal(y, w) for y, w in zip(saved[0]["logits"], want["logits"][:2], strict=True))
    for got in spawn_gloo(P.save_then_resume, 2, args=(path, "load"), timeout=300):
        assert torch.equal(got["logits"][0], want["logits"][2])
        for name, p in want["params"].items():
            assert torch.equal(got["params"][name], p), name
