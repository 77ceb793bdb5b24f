"""``blockshard.clip_grad_norm_`` on spawned gloo ranks (W = 2, 4, every rank the whole batch)
against one process with ``torch.nn.utils.clip_grad_norm_``: OddMLP and a tiny Llama, norm types
2, 1 and inf, default and "matrix" semantics (whole matrices on one rank: empty pieces elsewhere),
3 AdamW steps clipping every step. Tolerances as in test_fast_clip.py: the inf-norm and what it
trains are bitwise; p = 2 and 1 within a relative 1e-6 on the norm and 1e-6 on the parameters
(only the norm's summation order differs). Controls: torch's call on the local pieces.
"""

from __future__ import annotations

import functools

import _clip_runs as cr
import pytest

from blockshard._launch import run_single, spawn_gloo

pytestmark = pytest.mark.slow

KINDS = ["mlp", "llama"]
INF, PARAM_ATOL, check_matches = cr.INF, cr.PARAM_ATOL, cr.check_matches
NORMS = [2.0, 1.0, INF]
SEMANTICS = [None, "matrix"]
CASES = tuple(((k, p, s), (k, p), {"semantics": s}) for k in KINDS for p in NORMS for s in SEMANTICS)
CONTROLS = tuple(((k, p, "torch"), (k, p), {"how": "torch"}) for k in KINDS for p in (2.0, 1.0))
# torch.nn.utils.clip_grad_norm_ itself, routed by fully_shard, on layouts with empty pieces
ROUTED = tuple(
    ((k, p, "torch_routed"), (k, p), {"how": "torch_routed", "semantics": "matrix"}) for k in KINDS for p in NORMS
)


@functools.cache
def references() -> dict:
    refs = tuple(((k, p), (k, p), {}) for k in KINDS for p in NORMS)
    return run_single(cr.references, args=(refs,), timeout=300)


@functools.cache
def sharded(world: int) -> list[dict]:
    return spawn_gloo(cr.cases, world, args=(CASES + CONTROLS + ROUTED,), timeout=500)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("semantics", SEMANTICS)
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_one_process(kind, norm_type, semantics, world):
    got = [per_rank[(kind, norm_type, semantics)] for per_rank in sharded(world)]
    if semantics == "matrix":
        assert any(0 in shape for res in got for shape in res["shapes"])  # some rank holds an empty piece
    check_matches(got, references()[(kind, norm_type)], norm_type)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_torch_clip_grad_norm_on_a_sharded_model_matches_one_process(kind, norm_type, world):
    got = [per_rank[(kind, norm_type, "torch_routed")] for per_rank in sharded(world)]
    assert any(0 in shape for res in got for shape in res["shapes"])  # some rank holds an empty piece
    check_matches(got, references()[(kind, norm_type)], norm_type)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("norm_type", [2.0, 1.0])
@pytest.mark.parametrize("kind", KINDS)
def test_control_torch_clip_on_local_pieces(kind, norm_type, world):
    got = [per_rank[(kind, norm_type, "torch")] for per_rank in sharded(world)]
    want = references()[(kind, norm_type)]
    firsts = [res["norms"][0] for res in got]
    assert len({n.item() for n in firsts}) == world  # every rank its own norm
    assert all(abs(n - want["norms"][0]) > 0.1 * want["norms"][0] for n in firsts)
    diff = max((res["params"][k] - v).abs().max().item() for res in got for k, v in want["params"].items())
    assert diff > 100 * PARAM_ATOL
