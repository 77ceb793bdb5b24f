"""Collectives that do not line up raise on every rank within a bound ([Note: collective
integrity] in blockshard/runtime/core/_collectives.py); spawned gloo ranks, W = 2 and 4.

Every case runs ``_integrity.STEPS`` steps with one rank misbehaving in one step and asserts, for
every rank: a ``CollectiveIntegrityError`` whose message names the group and what differs,
raised within a bound derived from the collective timeout (``_integrity.TIMEOUT_S``), far below
gloo's own (here ``spawn_gloo``'s ``0.9 * timeout``, 108 s; 30 minutes by default). The control
runs the same steps on aligned ranks without error.
"""

from __future__ import annotations

import json

import _integrity
import pytest

from blockshard._launch import spawn_gloo

pytestmark = pytest.mark.slow

ERROR = "CollectiveIntegrityError: blockshard: "
# a rank waits at most one timeout per collective; a mismatch found by a timeout costs one, plus
# the peers' reports (1 s) and the steps themselves
BOUND_S = 2 * _integrity.TIMEOUT_S + 3


def _outcomes(name: str, tmp_path, world: int = 2, odd_rank: int = 1, funnel: bool = False) -> list[dict]:
    results = spawn_gloo(_integrity.case, world, args=(name, str(tmp_path), odd_rank, funnel), timeout=120)
    return results


def _raised_in_time(res: dict, rank: int) -> str:
    assert res["outcome"].startswith(ERROR), (rank, res["outcome"])
    assert res["seconds"] < BOUND_S, (rank, res["seconds"])
    return res["outcome"]


def test_control_aligned_ranks_train_without_error(tmp_path):
    for res in _outcomes("none", tmp_path):
        assert res["outcome"] == "no error"


def test_differing_requires_grad_raises_on_every_rank_before_the_optimizer_step(tmp_path):
    for rank, res in enumerate(_outcomes("requires_grad", tmp_path)):
        msg = _raised_in_time(res, rank)
        assert msg.startswith(ERROR + "the ranks' collectives for the model rooted at group 'Tower'")
        assert "requires_grad flags" in msg and "Fix: run the same forward, backward and optimizer step" in msg


def test_an_optimizer_step_one_rank_skipped_raises_on_every_rank_at_the_next_backward(tmp_path):
    for rank, res in enumerate(_outcomes("skipped_optimizer_step", tmp_path)):
        msg = _raised_in_time(res, rank)
        assert "optimizer steps (rank 0: 2, rank 1: 1)" in msg, msg


HEADERS = ERROR + "the ranks' collectives do not line up"


@pytest.mark.parametrize(
    ("name", "cause"),
    [
        ("extra_forward", "rank 1 ran a forward where the others ran the backward"),
        ("unused_module", "the ranks ran different modules or passes"),
        ("raised_in_forward", "the ranks ran different modules or passes"),
    ],
)
def test_collectives_that_cannot_pair_raise_on_every_rank_at_once(tmp_path, name, cause):
    """The ranks' next collectives differ: the headers ([Note: collective headers]) make every rank
    raise before issuing them, naming each rank's, without waiting for a timeout. (Before the
    headers, each rank waited the timeout in a collective its peer never issued; before the bounded
    engine group, gloo's 108 s.)"""
    for rank, res in enumerate(_outcomes(name, tmp_path)):
        msg = _raised_in_time(res, rank)
        assert msg.startswith(HEADERS) and cause in msg, msg
        assert "rank 0: the " in msg and "rank 1: the " in msg and "of group 'Linear' (layers." in msg, msg
        assert res["seconds"] < _integrity.TIMEOUT_S, (rank, res["seconds"])  # no timeout was waited for


@pytest.mark.parametrize(
    ("name", "cause"),
    [
        ("no_grad_forward", "rank 1 ran a forward where the others ran the backward: an extra forward"),
        ("skipped_backward", "rank 1 ran a forward where the others ran the backward: an extra forward"),
        ("gradient_sync_off", "gradient sync is off on rank 1 only (set_requires_gradient_sync(False)"),
        ("load_checkpoint_alone", "blockshard.load_checkpoint was called on rank 1 only"),
        ("full_state_dict_alone", "blockshard.full_state_dict was called on rank 1 only"),
    ],
)
def test_collectives_of_other_sizes_raise_on_every_rank_instead_of_aborting(tmp_path, name, cause):
    """Issue 29's cases on layers of other sizes, where the ranks' next collectives would pair
    buffers of other sizes (gloo: SIGABRT, "Received data size doesn't match expected size"; the
    control below): every rank raises blockshard's error naming the cause, at once."""
    for rank, res in enumerate(_outcomes(name, tmp_path, funnel=True)):
        msg = _raised_in_time(res, rank)
        assert msg.startswith(HEADERS) and cause in msg, msg
        assert "Nothing was exchanged" in msg and "Fix: run the same forward, backward and optimizer step" in msg
        assert res["seconds"] < _integrity.TIMEOUT_S, (rank, res["seconds"])


def test_control_without_headers_gloo_aborts_a_rank(tmp_path, monkeypatch):
    """The control: with BLOCKSHARD_COLLECTIVE_HEADERS=0 the same extra forward pairs buffers of
    other sizes and gloo kills a rank with SIGABRT (exit code -6), no Python error."""
    monkeypatch.setenv("BLOCKSHARD_COLLECTIVE_HEADERS", "0")
    with pytest.raises(RuntimeError, match=r"exited with code -6"):
        spawn_gloo(_integrity.case, 2, args=("no_grad_forward", str(tmp_path), 1, True), timeout=120, grace=10)


def test_control_aligned_ranks_of_other_sizes_train_without_error(tmp_path):
    for res in _outcomes("none", tmp_path, funnel=True):
        assert res["outcome"] == "no error"


def test_a_rank_that_never_steps_its_optimizer_raises_at_the_next_backward(tmp_path):
    """optimizer.step() on rank 0 only: rank 1 holds trainable elements, so its zero steps count."""
    for rank, res in enumerate(_outcomes("never_steps", tmp_path)):
        msg = _raised_in_time(res, rank)
        assert "optimizer steps (rank 0: 1, rank 1: 0)" in msg, msg


def test_an_unused_module_on_one_of_four_ranks_raises_on_every_rank(tmp_path):
    results = _outcomes("unused_module", tmp_path, world=4, odd_rank=2)
    for rank, res in enumerate(results):
        _raised_in_time(res, rank)


def test_a_dead_peer_makes_the_others_raise_naming_it(tmp_path):
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3"):
        spawn_gloo(_integrity.case, 2, args=("dead_peer", str(tmp_path)), timeout=120, grace=10)
    res = json.loads((tmp_path / "rank0.json").read_text())
    msg = _raised_in_time(res, 0)
    assert "on rank 0 of 2 did not complete" in msg and "of group 'Linear' (layers." in msg, msg
    assert "rank 1 of the group never reported a failure" in msg, msg


def test_a_skipped_step_raises_on_every_rank(tmp_path):
    """The rank that skipped a whole step issued exactly the collectives of a rank that ran one
    step fewer, so it finishes its loop; its peer's last step has no partner and raises, naming the
    rank that never reported; then spawn_gloo's end-of-training check (check_finished) makes the
    rank that skipped raise too, naming the peer's failure."""
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed") as info:
        spawn_gloo(_integrity.case, 2, args=("skipped_step", str(tmp_path)), timeout=120, grace=15)
    assert "CollectiveIntegrityError: blockshard: rank 0 of 2 failed (the header of the all-gather of group" in str(
        info.value
    )
    assert "finished training after 2 steps: the ranks did not run the same steps" in str(info.value)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    msg = _raised_in_time(rank0, 0)
    assert "rank 1 of the group never reported a failure" in msg, msg
    assert json.loads((tmp_path / "rank1.json").read_text())["outcome"] == "no error"  # inside its loop
