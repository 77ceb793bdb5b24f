"""Checkpoints are the ones they claim to be, and every write failure is a ``CheckpointError``
(issue 29, items 2, 4 and 5; [Note: checkpoint integrity] in
blockshard/runtime/checkpoint/_integrity.py), in process (W = 1, and W = 2 on threads):

* ranks that resolve different checkpoints (two real checkpoints of one model) raise on every
  rank; control: the same checkpoint on both ranks loads bitwise;
* 16 flipped bytes in a shard file raise naming the file on every rank; control: with
  ``verify=False`` the damaged file loads silently with other values;
* a malformed ``blockshard.json`` raises in ``load_checkpoint`` and is one line in ``inspect``;
* a full disk during ``save_checkpoint`` on one rank, and ``save_pretrained`` under a regular
  file or on a full disk, raise ``CheckpointError`` (an ``Exception``) on every rank, naming the
  path and the cause, with the previous checkpoint intact;
* ``load_safetensors`` names the file for damaged files and indexes, and refuses one tensor in
  two files without an index."""

from __future__ import annotations

import json
import os
import threading

import _inproc
import pytest
import torch
from _ckpt_models import sharded_odd_mlp as _sharded
from safetensors.torch import save_file
from torch import nn

import blockshard
from blockshard._tiny import mlp_batches
from blockshard.cli import main
from blockshard.runtime import CheckpointError, load_checkpoint, load_safetensors, save_checkpoint

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _w1(gloo_w1):
    return gloo_w1


def _trained(steps: int) -> nn.Module:
    model = _sharded()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in mlp_batches(steps, 4):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def _save_two(rank: int, world: int, root: str) -> None:
    save_checkpoint(_trained(1), os.path.join(root, "a"))
    save_checkpoint(_trained(2), os.path.join(root, "b"))


def _load(rank: int, world: int, paths: list[str]) -> object:
    model = _sharded(1)
    try:
        load_checkpoint(model, paths[rank])
    except CheckpointError as e:
        return str(e)
    return blockshard.full_state_dict(model)


@pytest.mark.heavy  # in process, seconds: out of `make test-fast` (its one-minute budget)
def test_ranks_that_resolve_different_checkpoints_raise_on_every_rank(tmp_path):
    _inproc.run_ranks(_save_two, 2, args=(str(tmp_path),))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    mixed = _inproc.run_ranks(_load, 2, args=([a, b],))
    assert all(isinstance(m, str) and "the ranks resolved different checkpoints" in m for m in mixed)
    same = _inproc.run_ranks(_load, 2, args=([a, a],))  # the control
    assert all(torch.equal(same[0][k], same[1][k]) for k in same[0])
    other = _inproc.run_ranks(_load, 2, args=([b, b],))
    assert not all(torch.equal(same[0][k], other[0][k]) for k in same[0])  # A and B differ


def _flip(path: str, n: int = 16) -> str:
    """Flip ``n`` bytes in the middle of the largest shard file; return its name."""
    name = max(
        (f for f in os.listdir(path) if f.endswith(".distcp")), key=lambda f: os.path.getsize(os.path.join(path, f))
    )
    full = os.path.join(path, name)
    data = bytearray(open(full, "rb").read())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    open(full, "wb").write(bytes(data))
    return name


@pytest.mark.heavy  # in process, seconds: out of `make test-fast` (its one-minute budget)
def test_flipped_bytes_in_a_shard_file_raise_naming_the_file_on_every_rank(tmp_path):
    _inproc.run_ranks(_save_two, 2, args=(str(tmp_path),))
    a = str(tmp_path / "a")
    want = _inproc.run_ranks(_load, 2, args=([a, a],))[0]
    name = _flip(a)
    got = _inproc.run_ranks(_load, 2, args=([a, a],))
    assert all(isinstance(g, str) and f"file {name!r} does not match its recorded CRC-32" in g for g in got)
    with _inproc.single_thread():
        model = _sharded(1)
        load_checkpoint(model, a, verify=False)  # the control: DCP itself loads the damage silently
        loaded = blockshard.full_state_dict(model)
    assert not all(torch.equal(want[k], loaded[k]) for k in want)


@pytest.mark.parametrize("record", [b"{not json", b"[1, 2]", b'{"saved_by": "someone else"}', b"\xff\xfe"])
def test_a_malformed_record_raises_in_load_and_is_one_line_in_inspect(tmp_path, capsys, record):
    path = str(tmp_path / "ckpt")
    with _inproc.single_thread():
        model = _sharded()
        save_checkpoint(model, path)
        (tmp_path / "ckpt" / "blockshard.json").write_bytes(record)
        with pytest.raises(CheckpointError, match=r"blockshard\.json (cannot be read|is not a blockshard record)"):
            load_checkpoint(model, path)
    assert main(["inspect", path]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("blockshard inspect: error: ")
        and "blockshard.json" in err
        and "\n" not in err
        and "Traceback" not in err
    )


_DISK_FULL = threading.Event()


def _full_disk_on_rank1(rank: int, world: int, path: str) -> str:
    save_checkpoint(_sharded(), path)
    if rank == 1:
        _DISK_FULL.set()  # rank 1's disk is full from its second save on
    try:
        save_checkpoint(_trained(1), path)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


def test_a_full_disk_on_one_rank_raises_checkpoint_error_on_every_rank_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    path = str(tmp_path / "ckpt")
    write = FileSystemWriter.write_data

    def full_disk(self, plan, planner):
        if dist.get_rank() == 1 and _DISK_FULL.is_set():
            raise OSError(28, "No space left on device")
        return write(self, plan, planner)

    _DISK_FULL.clear()
    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    got = _inproc.run_ranks(_full_disk_on_rank1, 2, args=(path,))
    monkeypatch.undo()
    for g in got:
        assert g.startswith(f"CheckpointError: save_checkpoint({path!r}) failed while writing: on rank 1: OSError")
        assert "No space left on device" in g and "the previous checkpoint at that path, if any, is unchanged" in g
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    with _inproc.single_thread():
        load_checkpoint(_sharded(1), path)  # the previous checkpoint, intact (its checksums verified)


class _FullDisk:
    """A file on a full disk: every write fails as the OS says so."""

    def write(self, data: object) -> int:
        raise OSError(28, "No space left on device")

    def close(self) -> None:
        pass


def _export(rank: int, world: int, path: str) -> str:
    try:
        blockshard.save_pretrained(_trained(1), path)
    except CheckpointError as e:
        return str(e)
    return "exported"


@pytest.mark.heavy  # in process, seconds: out of `make test-fast` (its one-minute budget)
def test_save_pretrained_failures_raise_on_every_rank(tmp_path, monkeypatch):
    (tmp_path / "file").write_bytes(b"x")
    under_file = str(tmp_path / "file" / "export")
    got = _inproc.run_ranks(_export, 2, args=(under_file,))
    assert all(f"save_pretrained({under_file!r}) failed on rank 0: " in g and "Errno" in g for g in got)
    assert _inproc.run_ranks(_export, 2, args=(str(tmp_path / "ok"),)) == ["exported"] * 2  # the control
    from blockshard.runtime.checkpoint import _export as export_module

    real_open = open
    monkeypatch.setattr(
        export_module,
        "open",
        lambda f, mode="r", *a, **k: _FullDisk() if "b" in mode else real_open(f, mode, *a, **k),
        raising=False,
    )
    got = _inproc.run_ranks(_export, 2, args=(str(tmp_path / "full"),))  # rank 0's disk fills while peers send
    assert all("No space left on device" in g and "The export there is incomplete" in g for g in got)


def _small(tmp_path) -> tuple[nn.Module, str]:
    with _inproc.serial():
        model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    state = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    blockshard.fully_shard(model[0])
    blockshard.fully_shard(model)
    return model, str(tmp_path / "model.safetensors")


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated", "header"])
def test_load_safetensors_names_a_damaged_file(tmp_path, damage):
    model, file = _small(tmp_path)
    data = open(file, "rb").read()
    damaged = {
        "garbage": b"\x13" * 100,
        "empty": b"",
        "truncated": data[: len(data) - 16],
        "header": data[:9] + b"!" + data[10:],  # the JSON header broken
    }[damage]
    open(file, "wb").write(damaged)
    with pytest.raises(CheckpointError, match=rf"load_safetensors: {file!r} cannot be read"):
        load_safetensors(model, str(tmp_path))


@pytest.mark.parametrize(
    ("index", "text"),
    [
        (b"{not json", "cannot be read"),
        (b"[]", "has no weight_map"),
        (json.dumps({"weight_map": {"0.weight": 3}}).encode(), "has no weight_map"),
        (json.dumps({"weight_map": {"0.weight": "gone.safetensors"}}).encode(), r"names files that are not in"),
    ],
)
def test_load_safetensors_validates_the_index(tmp_path, index, text):
    model, _ = _small(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_bytes(index)
    with pytest.raises(CheckpointError, match=text):
        load_safetensors(model, str(tmp_path))


def test_one_tensor_in_two_files_without_an_index_is_refused(tmp_path):
    model, _ = _small(tmp_path)
    load_safetensors(model, str(tmp_path))  # the control: one file loads
    save_file({"0.weight": torch.zeros(5, 7)}, str(tmp_path / "stale.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor '0.weight' is in both .*model.safetensors' and .*stale"):
        load_safetensors(model, str(tmp_path))


def _export_and_load(rank: int, world: int, path: str, flip: bool) -> object:
    model = _trained(1)
    blockshard.save_pretrained(model, path)
    want = blockshard.full_state_dict(model)
    if flip and rank == 0:
        _flip_file(
            max((os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")), key=os.path.getsize)
        )
    import torch.distributed as dist

    dist.barrier()
    out = {}
    for verify in (True, False):
        fresh = _sharded(1)
        try:
            load_safetensors(fresh, path, verify=verify)
            got = blockshard.full_state_dict(fresh)
            out[verify] = all(torch.equal(want[k], got[k]) for k in want)
        except CheckpointError as e:
            out[verify] = str(e)
    return out


def _flip_file(full: str, n: int = 16) -> None:
    data = bytearray(open(full, "rb").read())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    open(full, "wb").write(bytes(data))


@pytest.mark.heavy  # in process, seconds: out of `make test-fast` (its one-minute budget)
def test_flipped_bytes_in_an_exported_safetensors_file_raise_naming_the_file(tmp_path):
    got = _inproc.run_ranks(_export_and_load, 2, args=(str(tmp_path / "export"), True))
    for g in got:
        assert "does not match the size and CRC-32 its model.safetensors.index.json recorded" in g[True]
        assert g[False] is False  # the control: safetensors itself loads the damage silently
    clean = _inproc.run_ranks(_export_and_load, 2, args=(str(tmp_path / "clean"), False))
    assert clean == [{True: True, False: True}] * 2  # the control: an intact export loads exactly
