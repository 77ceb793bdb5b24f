"""``blockshard.clip_grad_norm_`` against one process with torch's ``clip_grad_norm_``, in-process
(W = 2 on threaded gloo ranks, see _inproc.py); the spawned W = 2, 4 versions are in test_clip.py.

Tolerances ([Note: clipping] in blockshard/runtime/core/_clip.py): every rank trains on the whole
batch, so the gradients are one process's exactly; only the norm's summation order differs (per
rank, then across ranks, instead of tensor by tensor). The inf-norm (a max) is exact, so it and
the parameters trained with it are **bitwise** equal. For p = 2 and 1 the total norm is held to
a relative 1e-6 (float32 ulp 1.2e-7; measured <= 4.6e-7 at W = 2 and 4, MLP and tiny Llama)
and the parameters after 3 steps to 1e-6 (measured AdamW <= 1.5e-7, SGD <= 7.5e-9): a clip
factor a few ulps off moves each update by as many ulps. The control (torch's call on the local pieces) is off by >= 20% in the
norm and >= 2e-4 in the parameters, so the tolerance cannot hide it.
"""

from __future__ import annotations

import functools

import _clip_runs as cr
import _inproc
import pytest
import torch

import blockshard
from blockshard.runtime import ClipError

pytestmark = pytest.mark.timeout(60)  # in-process ranks: a hang fails the test, never the run

INF, NORM_RTOL, PARAM_ATOL, check_matches = cr.INF, cr.NORM_RTOL, cr.PARAM_ATOL, cr.check_matches


@pytest.fixture(autouse=True)
def _w1(gloo_w1):
    return gloo_w1


@functools.cache
def reference(norm_type: float, optimizer: str = "adamw") -> dict:
    with _inproc.single_thread():
        return cr.train(0, 1, "mlp", norm_type, sharded=False, optimizer=optimizer)


def _heavy(norm_type: float) -> object:
    """A norm type whose case is heavy: in process, out of `make test-fast` (its one-minute budget)."""
    return pytest.param(norm_type, marks=pytest.mark.heavy)


@pytest.mark.parametrize("norm_type", [2.0, _heavy(1.0), INF])
@pytest.mark.parametrize("semantics", [None, "matrix"])
def test_global_norm_and_clipping_match_one_process(norm_type, semantics):
    got = _inproc.run_ranks(cr.train, 2, args=("mlp", norm_type), kwargs={"sharded": True, "semantics": semantics})
    want = reference(norm_type)
    assert all(g["norms"][0] > cr.MAX_NORM[norm_type] for g in got)  # it really clipped
    if semantics == "matrix":  # whole matrices on one rank: the other holds an empty piece
        assert any(0 in shape for shape in got[0]["shapes"] + got[1]["shapes"])
    check_matches(got, want, norm_type)


@pytest.mark.parametrize("norm_type", [2.0, _heavy(INF)])
def test_model_parameters_work_as_well_as_the_model(norm_type):
    got = _inproc.run_ranks(cr.train, 2, args=("mlp", norm_type), kwargs={"sharded": True, "how": "params"})
    check_matches(got, reference(norm_type), norm_type)


def test_sgd_shows_the_clip_in_full():
    """SGD's update is linear in the gradient, so a wrong clip factor cannot hide behind Adam's scaling."""
    got = _inproc.run_ranks(cr.train, 2, args=("mlp", 2.0), kwargs={"sharded": True, "optimizer": "sgd"})
    check_matches(got, reference(2.0, "sgd"), 2.0)


@pytest.mark.parametrize("norm_type", [2.0, _heavy(1.0), _heavy(INF)])
def test_torch_clip_grad_norm_is_routed_to_the_global_norm(norm_type):
    """[Note: clipping]: torch.nn.utils.clip_grad_norm_ on a sharded model, as Accelerate and the HF
    Trainer call it, returns the global norm on every rank, with empty pieces (the control below
    runs torch's own function)."""
    kwargs = {"sharded": True, "how": "torch_routed", "semantics": "matrix"}
    got = _inproc.run_ranks(cr.train, 2, args=("mlp", norm_type), kwargs=kwargs)
    assert any(0 in shape for shape in got[0]["shapes"] + got[1]["shapes"])
    check_matches(got, reference(norm_type), norm_type)


def test_the_route_leaves_other_tensors_to_torch_and_is_installed_once(gloo_w1):
    blockshard.fully_shard(torch.nn.Linear(2, 2))
    blockshard.fully_shard(torch.nn.Linear(2, 2))
    routed = torch.nn.utils.clip_grad_norm_
    assert (
        routed is torch.nn.utils.clip_grad.clip_grad_norm_ and "clip_grad_norm_" in blockshard.installed_torch_routes()
    )
    route = routed.__closure__[0].cell_contents  # the route in torch's no_grad wrapper
    assert route.__wrapped__ is routed.__wrapped__  # wraps torch's implementation, not itself
    plain = torch.nn.Parameter(torch.ones(3))
    plain.grad = torch.full((3,), 4.0)
    assert routed(iter([plain]), 1.0).item() == pytest.approx(48**0.5)  # a generator, as torch takes
    torch.testing.assert_close(plain.grad, torch.full((3,), 4.0 / (48**0.5 + 1e-6)))


@pytest.mark.parametrize("norm_type", [2.0, _heavy(1.0)])
def test_control_torch_clip_grad_norm_on_local_pieces_is_wrong(norm_type):
    got = _inproc.run_ranks(cr.train, 2, args=("mlp", norm_type), kwargs={"sharded": True, "how": "torch"})
    want = reference(norm_type)
    n0, n1, ref = got[0]["norms"][0], got[1]["norms"][0], want["norms"][0]
    assert not torch.equal(n0, n1)  # each rank clips by its own factor
    assert min(abs(n0 - ref), abs(n1 - ref)) > 0.15 * ref  # and neither is the true norm (measured >= 20%)
    diff = max((g["params"][k] - v).abs().max().item() for g in got for k, v in want["params"].items())
    assert diff > 100 * PARAM_ATOL


def test_control_torch_inf_norm_raises_on_an_empty_piece():
    with pytest.raises(RuntimeError, match="infinity norm on an empty tensor"):
        _inproc.run_ranks(cr.train, 2, args=("mlp", INF), kwargs={"sharded": True, "how": "torch", "steps": 1})


def test_replicated_parameters_are_counted_once():
    with _inproc.single_thread():
        want = cr.with_replicated(0, 1, sharded=False)
    for res in _inproc.run_ranks(cr.with_replicated, 2, args=(True,)):
        torch.testing.assert_close(res["norm"], want["norm"], rtol=NORM_RTOL, atol=0)
        torch.testing.assert_close(res["extra_grad"], want["extra_grad"], rtol=NORM_RTOL, atol=0)


def test_a_nonfinite_piece_on_one_rank_raises_on_every_rank():
    for msg in _inproc.run_ranks(cr.nonfinite, 2):
        assert "non-finite" in msg


def test_at_w1_it_is_torch_clip_grad_norm(gloo_w1):
    with _inproc.single_thread():
        got = cr.train(0, 1, "mlp", INF, sharded=True)
    check_matches([got], reference(INF), INF)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"norm_type": 0}, "norm_type=0 is not a p-norm"),
        ({"norm_type": -INF}, "norm_type=-inf"),
        ({"norm_type": "two"}, "norm_type='two'"),
        ({"max_norm": -1.0}, r"max_norm=-1.0 must be a number >= 0"),
    ],
)
def test_bad_arguments_name_the_value_and_the_fix(kwargs, match):
    args = {"max_norm": 1.0, **kwargs}
    with pytest.raises(ClipError, match=match):
        blockshard.clip_grad_norm_(torch.nn.Linear(2, 2), **args)


def test_a_non_tensor_in_the_parameters_is_named():
    with pytest.raises(ClipError, match=r"parameters\[1\] is a str"):
        blockshard.clip_grad_norm_([torch.zeros(2), "w"], 1.0)


def test_unsharded_tensors_are_clipped_as_torch_does():
    """No sharded piece: no collective, and the norm and the clipped gradients are torch's, bitwise."""
    mine, theirs = ([torch.nn.Parameter(torch.ones(3)) for _ in range(2)] for _ in range(2))
    for ps in (mine, theirs):
        ps[0].grad, ps[1].grad = torch.full((3,), 2.0), torch.full((3,), -3.0)
    total = blockshard.clip_grad_norm_(mine, 1.0, 2.0)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0, 2.0)
    torch.testing.assert_close(total, want, rtol=NORM_RTOL, atol=0)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=NORM_RTOL, atol=0)
