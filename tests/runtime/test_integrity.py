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


def _outcomes(name: str, tmp_path, world: int = 2, odd_rank: int = 1) -> list[dict]:
    results = spawn_gloo(_integrity.case, world, args=(name, str(tmp_path), odd_rank), timeout=120)
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


@pytest.mark.parametrize("name", ["extra_forward", "unused_module", "raised_in_forward"])
def test_collectives_that_cannot_pair_raise_on_every_rank_within_the_timeout(tmp_path, name):
    """gloo pairs nothing here: every rank waits in a collective its peer never issues. Before the
    engine's bounded group, rank 0 waited gloo's 108 s (the reduce-scatter runs inline)."""
    for rank, res in enumerate(_outcomes(name, tmp_path)):
        msg = _raised_in_time(res, rank)
        assert "of group 'Linear' (layers." in msg or "group 'Tower'" in msg, msg
        assert "Peers: rank" in msg, msg  # the peer's own report is named


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
    assert "CollectiveIntegrityError: blockshard: rank 0 of 2 failed (the all-gather of group" in str(info.value)
    assert "finished training after 2 steps: the ranks did not run the same steps" in str(info.value)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    msg = _raised_in_time(rank0, 0)
    assert "rank 1 of the group never reported a failure" in msg, msg
    assert json.loads((tmp_path / "rank1.json").read_text())["outcome"] == "no error"  # inside its loop
