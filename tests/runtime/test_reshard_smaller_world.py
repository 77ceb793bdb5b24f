"""An int ``reshard_after_forward`` at W = 4 (FSDP2's smaller world after forward; [Note: reshard to a
smaller world] in blockshard/runtime/core/_post_forward.py), on spawned gloo ranks: training equal
to ``True`` bitwise, to one process and to stock FSDP2 with the same int at float32 tolerance; the
all-gathers FSDP2 issues (forward over W, backward within the k-group); and what a rank holds
between forward and backward (a run of W/k segments, against ``True`` and ``False``)."""

from __future__ import annotations

import _smaller_world_runs as runs
import pytest
import torch

from blockshard._launch import spawn_gloo

pytestmark = pytest.mark.slow

W, K = 4, 2


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


# every plain run of this file, by (engine, reshard_after_forward of the blocks, of the root)
PLAIN = [("blockshard", K, None), ("blockshard", True, None), ("blockshard", False, None)]
PLAIN += [("fsdp2", K, None), ("blockshard", K, K), ("fsdp2", K, K)]


@pytest.fixture(scope="module")
def plain() -> dict[tuple[str, object, object], list[dict]]:
    """One spawn of W ranks runs them all, one after the other (starting ranks is most of the time)."""
    results = spawn_gloo(runs.many, W, args=("train", PLAIN), timeout=600)
    return {args: [r[i] for r in results] for i, args in enumerate(PLAIN)}


@pytest.fixture(scope="module")
def blocks_int(plain) -> list[dict]:
    """Every block at ``reshard_after_forward=2``, the root at its default (None: keeps its own)."""
    return plain["blockshard", K, None]


@pytest.fixture(scope="module")
def blocks_true(plain) -> list[dict]:
    return plain["blockshard", True, None]


@pytest.fixture(scope="module")
def blocks_false(plain) -> list[dict]:
    return plain["blockshard", False, None]


def test_training_with_a_smaller_world_is_bitwise_true_s_and_one_process_s(blocks_int, blocks_true, blocks_false):
    full, kept = blocks_true, blocks_false
    got, reference = blocks_int[0]["params"], blocks_int[0]["reference"]
    assert all(_equal(r["params"], got) for r in blocks_int)  # every rank's full parameters agree
    assert _equal(got, full[0]["params"]) and _equal(got, kept[0]["params"])
    for n, want in reference.items():
        torch.testing.assert_close(got[n], want, msg=lambda m, n=n: f"{n}: {m}")
    moved = {n: not torch.equal(got[n], p) for n, p in runs._full_initial().items()}
    assert all(moved.values()), f"parameters that never changed (the comparison could not fail): {moved}"


def test_stock_fsdp2_with_the_same_int_trains_the_same_parameters(plain, blocks_int):
    fsdp2 = plain["fsdp2", K, None]
    for n, want in fsdp2[0]["params"].items():
        torch.testing.assert_close(blocks_int[0]["params"][n], want, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("root_raf", [None, K], ids=["root default", "root int"])
def test_all_gathers_are_fsdp2_s_forward_over_w_backward_within_the_k_group(plain, root_raf):
    """FSDP2's own count (torch's test_fully_shard_comm ``_test_communication_count``): forward
    one all-gather per group over W; backward one per group that resharded (the root at None keeps
    its parameters), within k ranks. Stock FSDP2 in the same run issues exactly the same."""
    mine, theirs = plain["blockshard", K, root_raf], plain["fsdp2", K, root_raf]
    backward = runs.N_BLOCKS + (root_raf is not None)
    want = {"forward": [W] * (runs.N_BLOCKS + 1), "backward": [K] * backward}
    for rank in range(W):
        assert mine[rank]["phases"] == want, (rank, mine[rank]["phases"])
        assert theirs[rank]["phases"] == want, (rank, theirs[rank]["phases"])
    # the engine's own counters: STEPS steps of the same, its traffic as planned
    rows = {(group, kind, ranks): (calls, ok) for group, _, kind, ranks, calls, ok in mine[0]["counts"]}
    for i in range(runs.N_BLOCKS):
        assert rows[(f"layers.{i}", "all-gather", W)] == (runs.STEPS, True)
        assert rows[(f"layers.{i}", "all-gather", K)] == (runs.STEPS, True)
        assert rows[(f"layers.{i}", "reduce-scatter", W)] == (runs.STEPS, True)
    assert rows[("", "all-gather", W)] == (runs.STEPS, True)
    assert (("", "all-gather", K) in rows) == (root_raf is not None)


def test_between_forward_and_backward_a_rank_holds_w_over_k_segments(blocks_int, blocks_true, blocks_false):
    """The control: True holds the shards alone, False the whole gathered buffers (W segments)."""
    full, kept = blocks_true, blocks_false
    S = blocks_int[0]["held"]["local"]
    assert blocks_int[0]["held"] == {"local": S, "run": W // K * S, "gathered": 0}
    assert full[0]["held"] == {"local": S, "run": 0, "gathered": 0}
    assert kept[0]["held"] == {"local": S, "run": 0, "gathered": W * S}


VARIANTS = ("mp", "offload", "frozen_mixed")


@pytest.fixture(scope="module")
def variants() -> dict[tuple[str, object], list[dict]]:
    """Each variant under the int and under ``True``: one spawn of W ranks runs them all."""
    calls = [("blockshard", raf, None, v) for v in VARIANTS for raf in (K, True)]
    results = spawn_gloo(runs.many, W, args=("train", calls), timeout=600)
    return {(args[3], args[1]): [r[i] for r in results] for i, args in enumerate(calls)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_mixed_precision_offload_and_frozen_dtypes_train_as_under_true(variants, variant):
    got, want = variants[variant, K], variants[variant, True]
    assert _equal(got[0]["params"], want[0]["params"])
    sets = 2 if variant == "frozen_mixed" else 1  # a buffer set per dtype, each gathered within k
    assert got[0]["phases"]["backward"] == [K] * runs.N_BLOCKS * sets
    if variant == "frozen_mixed":  # each block's frozen float64 buffer set is gathered within k too
        rows = [r for r in got[0]["counts"] if r[2] == "all-gather" and r[3] == K and "float64" in r[1]]
        assert len(rows) == runs.N_BLOCKS and all(r[4] == runs.STEPS for r in rows), got[0]["counts"]


def test_hsdp_cuts_each_replica_s_shard_group_and_trains_as_under_true():
    results = spawn_gloo(runs.many, 8, args=("hsdp", [(K,), (True,)]), timeout=600)
    got, want = results[0]
    assert _equal(got["params"], want["params"])
    assert got["backward"] == [K] * runs.N_BLOCKS and want["backward"] == [W] * runs.N_BLOCKS


def test_a_non_factor_and_a_quantized_gather_are_refused_naming_the_fix():
    said = spawn_gloo(runs.refusals, W, timeout=240)[0]
    assert "reshard_after_forward=3 must be" in said["3"] and "one of [1, 2, 4]" in said["3"]
    assert "Fix:" in said["3"]
    assert "quantized_gather=True" in said["quantized"] and "Fix: pass reshard_after_forward=True" in said["quantized"]
