"""torch's ``get_state_dict`` / ``set_state_dict`` on a blockshard model on spawned gloo ranks (see
_torch_state_dict_runs.py): saved at W = 4, loaded at W = 2 and 4, AdamW, bitsandbytes AdamW8bit
(also over every piece, empty ones too) and a tied embedding/head.

Tolerances: bitwise. Every rank sees the whole batch at W in {2, 4}, where the average of identical
gradients is exact (docs/design.md "Sharding invariance"), so the sharded run equals the unsharded
one; full state dicts are gathered copies; loading is a copy. Controls: torch's own helpers
(unwrapped) return PieceTensors holding one rank's piece and the optimizer's local state under
``full_state_dict=True``; resuming the model without the optimizer state misses the run.
"""

from __future__ import annotations

import functools
import tempfile

import _torch_state_dict_runs as tr
import pytest
import torch

from blockshard._launch import run_single, spawn_gloo

pytestmark = pytest.mark.slow

TIMEOUT = 180


@functools.cache
def _dir() -> str:
    return tempfile.mkdtemp(prefix="blockshard-dsd-")  # removed with the machine's tmp; a few hundred KB


@functools.cache
def reference() -> dict:
    return run_single(tr.reference, timeout=TIMEOUT)


@functools.cache
def saved() -> list[dict]:
    return spawn_gloo(tr.save, 4, args=(_dir(),), timeout=TIMEOUT)


@functools.cache
def loaded(world: int) -> list[dict]:
    saved()  # the checkpoint saved at W = 4
    return spawn_gloo(tr.load, world, args=(_dir(), reference()), timeout=TIMEOUT)


def _differences(a: object, b: object, path: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ: keys, types, shapes, dtypes, values (bitwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if type(a) is not type(b) or a.shape != b.shape or a.dtype != b.dtype:
            return [
                f"{path}: {type(a).__name__} {getattr(a, 'shape', a)} vs {type(b).__name__} {getattr(b, 'shape', b)}"
            ]
        return [] if torch.equal(a, b) else [f"{path}: values differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a.keys() ^ b.keys())} in one only"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{path}.{i}")]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


@pytest.mark.parametrize("name", tr.NAMES)
def test_full_state_dicts_equal_the_unsharded_models(name):
    ref = reference()[name]
    for r in saved():
        model, optim = r[name]["full"]
        assert not _differences(model, ref["model"])  # names (tied too), shapes, dtypes, values
        assert not _differences(optim, ref["optim"])  # state by name, bnb's nested 8-bit state, param_groups
    for r in loaded(2):  # and at W = 2, after loading the unsharded run's full state dicts
        assert not _differences(r[name]["full_again"][0], ref["model"])
        assert not _differences(r[name]["full_again"][1], ref["optim"])


@pytest.mark.parametrize("name", tr.NAMES)
def test_an_unsharded_model_in_the_same_process_keeps_torchs_behaviour(name):
    for r in saved():  # after fully_shard wrapped torch's helpers
        assert not _differences(r[name]["unsharded_full"][0], reference()[name]["model"])
        assert not _differences(r[name]["unsharded_full"][1], reference()[name]["optim"])


def test_tied_names_share_one_gathered_tensor():
    assert set(reference()["tied"]["model"]) >= {"embed.weight", "head.weight"}
    assert all(r["tied"]["tied_one_tensor"] for r in saved())


@pytest.mark.parametrize("name", tr.NAMES)
def test_cpu_offload_leaves_the_full_state_dicts_on_rank_0_only(name):
    ranks = saved()
    model, optim = ranks[0][name]["offload"]
    assert not _differences(model, reference()[name]["model"])
    assert not _differences(optim, reference()[name]["optim"])
    assert all(r[name]["offload"] == ({}, {}) for r in ranks[1:])  # as torch does for FSDP2's DTensors


@pytest.mark.parametrize("name", tr.NAMES)
def test_the_control_torch_alone_returns_local_pieces_under_full_state_dict(name):
    shapes = {k: tuple(v.shape) for k, v in reference()[name]["model"].items()}
    for r in saved():
        model, optim = r[name]["control"]
        assert {k: v[:2] for k, v in model.items()} == {k: ("PieceTensor", s) for k, s in shapes.items()}
        assert sum(n for _, _, n in model.values()) < sum(torch.Size(s).numel() for s in shapes.values())
        local = {n: tuple(e["exp_avg"].shape) for n, e in optim["state"].items() if "exp_avg" in e}
        full = {n: tuple(e["exp_avg"].shape) for n, e in reference()[name]["optim"]["state"].items() if "exp_avg" in e}
        assert local != full or name.startswith("bnb8bit")  # AdamW: the pieces' block shapes
    bnb = saved()[1]["bnb8bit"]["control"][1]["state"]["0.0.weight"]["__bnb_optimizer_quant_state__"]["state1"]
    assert bnb.numel() < 256 * 97  # one rank's 8-bit codes under the full tensor's name


def test_the_sharded_run_equals_the_unsharded_one():
    for name in tr.NAMES:
        assert all(not _differences(r[name]["final"], reference()[name]["final"]) for r in saved())


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", tr.NAMES)
def test_set_state_dict_full_or_sharded_restores_training_bitwise(name, world):
    want = reference()[name]["final"]
    for r in loaded(world):
        assert not _differences(r[name]["from_full"], want)  # the unsharded run's full state dicts
        assert not _differences(r[name]["from_sharded"], want)  # dcp.load of the W = 4 sharded state dicts
        assert not _differences(r[name]["from_flat"], want)  # flatten_optimizer_state_dict=True
        assert _differences(r[name]["model_only"], want)  # control: a fresh optimizer misses it


@pytest.mark.parametrize("name", tr.NAMES)
def test_flattened_optimizer_state_dicts_equal_torchs_flattening_of_the_unsharded_one(name):
    import copy

    import torch.distributed.checkpoint.state_dict as dsd

    want = dsd._flatten_optim_state_dict(copy.deepcopy(reference()[name]["optim"]))
    for r in loaded(2):
        assert not _differences(r[name]["flat_again"], want)


@pytest.mark.parametrize("name", tr.NAMES)
def test_broadcast_from_rank0_restores_training_bitwise(name):
    for r in loaded(2):  # only rank 0 passed the state dicts
        assert not _differences(r[name]["broadcast"], reference()[name]["model"])
        assert not _differences(r[name]["from_broadcast"], reference()[name]["final"])
