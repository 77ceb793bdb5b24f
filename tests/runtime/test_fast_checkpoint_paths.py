"""What ``save_checkpoint`` may replace (issue 29, item 1; [Note: what a save may replace] in
blockshard/runtime/checkpoint/_files.py): a save swaps its whole directory, so a path holding
anything but a blockshard checkpoint raises ``CheckpointError`` before anything is written, and
the user's files stay byte for byte; a save that raises leaves no partial directory.
Controls: an empty directory and an earlier blockshard checkpoint at the same path are replaced
(the save that is refused elsewhere works there); before the fix ``outputs/`` with ``train.log``
was emptied silently."""

from __future__ import annotations

import os

import _inproc
import pytest
import torch
from _ckpt_models import sharded_odd_mlp as _sharded

import blockshard
from blockshard.runtime import CheckpointError, describe_checkpoint, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.timeout(60)

USER_FILES = {"train.log": b"step 1 loss 2.3\n", "sub/notes.txt": b"keep me\x00\xff"}


@pytest.fixture(autouse=True)
def _w1(gloo_w1):
    return gloo_w1


def _user_dir(root) -> str:
    out = root / "outputs"
    for name, data in USER_FILES.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    return str(out)


def _tree(root) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            full = os.path.join(dirpath, f)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, root)] = fh.read()
    return out


def test_a_directory_with_the_users_files_is_refused_and_kept_byte_for_byte(tmp_path):
    outputs = _user_dir(tmp_path)
    before = _tree(tmp_path)
    with _inproc.single_thread():
        model = _sharded()
        with pytest.raises(CheckpointError, match=r"holds files that are not a blockshard checkpoint's \('sub/', "):
            save_checkpoint(model, outputs)
        assert _tree(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["outputs"]  # nothing written
        save_checkpoint(model, os.path.join(outputs, "checkpoint"))  # control: a directory of its own
        assert describe_checkpoint(os.path.join(outputs, "checkpoint"))["complete"]
        assert {k: v for k, v in _tree(tmp_path).items() if "checkpoint" not in k} == before


@pytest.mark.parametrize("how", [".", "absolute", "parent"])
def test_the_working_directory_and_its_parents_are_refused(tmp_path, monkeypatch, how):
    outputs = _user_dir(tmp_path)
    os.remove(os.path.join(outputs, "train.log"))
    os.remove(os.path.join(outputs, "sub", "notes.txt"))  # an empty tree: refused all the same
    monkeypatch.chdir(os.path.join(outputs, "sub"))
    path = {".": ".", "absolute": os.path.join(outputs, "sub"), "parent": ".."}[how]
    with _inproc.single_thread():
        with pytest.raises(CheckpointError, match=r"is the working directory .* or holds it"):
            save_checkpoint(_sharded(), path)
    assert sorted(os.listdir(tmp_path)) == ["outputs"] and os.listdir(outputs) == ["sub"]


def test_root_a_file_a_path_under_a_file_a_link_and_a_plain_dcp_checkpoint_are_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    (tmp_path / "file").write_bytes(b"data")
    (tmp_path / "target").mkdir()
    os.symlink(tmp_path / "target", tmp_path / "link")
    with _inproc.single_thread():
        model = _sharded()
        dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "plain"))
        plain = _tree(tmp_path / "plain")
        cases = {
            "/": "the file system's root cannot hold a checkpoint",
            str(tmp_path / "file"): "is a file, not a checkpoint directory",
            str(tmp_path / "file" / "ckpt"): "is a file, so no directory can be made under it",
            str(tmp_path / "link"): "is a symbolic link",
            str(tmp_path / "plain"): "holds a checkpoint that blockshard.save_checkpoint did not write",
        }
        for path, text in cases.items():
            with pytest.raises(CheckpointError, match=text):
                save_checkpoint(model, path)
    assert sorted(os.listdir(tmp_path)) == ["file", "link", "plain", "target"]  # no partial directory anywhere
    assert _tree(tmp_path / "plain") == plain and (tmp_path / "file").read_bytes() == b"data"


def test_a_sibling_the_swap_would_remove_is_checked_too(tmp_path):
    (tmp_path / ".ckpt.old").mkdir()
    (tmp_path / ".ckpt.old" / "mine.txt").write_bytes(b"x")
    with _inproc.single_thread():
        model = _sharded()
        with pytest.raises(CheckpointError, match=r"uses .*\.ckpt\.old' for its swap.*'mine\.txt'"):
            save_checkpoint(model, str(tmp_path / "ckpt"))
        assert (tmp_path / ".ckpt.old" / "mine.txt").read_bytes() == b"x"
        os.remove(tmp_path / ".ckpt.old" / "mine.txt")
        (tmp_path / "ckpt").mkdir()  # control: an empty directory and an empty sibling are fine
        save_checkpoint(model, str(tmp_path / "ckpt"))
        save_checkpoint(model, str(tmp_path / "ckpt"))  # and so is the checkpoint it just wrote
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_checkpoint_with_a_file_added_to_it_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    with _inproc.single_thread():
        model = _sharded()
        save_checkpoint(model, path)
        (tmp_path / "ckpt" / "README.md").write_bytes(b"my notes")
        with pytest.raises(CheckpointError, match=r"'README\.md'"):
            save_checkpoint(model, path)
    assert (tmp_path / "ckpt" / "README.md").read_bytes() == b"my notes"


def test_a_save_that_raises_removes_its_partial_directory(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    path = str(tmp_path / "ckpt")
    with _inproc.single_thread():
        model = _sharded()
        save_checkpoint(model, path)
        want = blockshard.full_state_dict(model)
        write = FileSystemWriter.write_data

        def fails_after_writing(self, plan, planner):
            write(self, plan, planner).wait()
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(FileSystemWriter, "write_data", fails_after_writing)
        with pytest.raises(CheckpointError, match="No space left on device"):
            save_checkpoint(_sharded(1), path)
        monkeypatch.undo()
        assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the partial directory is gone
        resumed = _sharded(2)
        load_checkpoint(resumed, path)
        assert all(torch.equal(want[k], v) for k, v in blockshard.full_state_dict(resumed).items())


def _refused_on_every_rank(rank: int, world: int, outputs: str) -> str:
    model = _sharded()
    try:
        save_checkpoint(model, outputs)
    except CheckpointError as e:
        return str(e)
    return "saved"


def test_the_refusal_is_raised_on_every_rank_before_anything_is_written(tmp_path):
    outputs = _user_dir(tmp_path)
    before = _tree(tmp_path)
    errors = _inproc.run_ranks(_refused_on_every_rank, 2, args=(outputs,))
    assert len(set(errors)) == 1 and "train.log" in errors[0]
    assert _tree(tmp_path) == before


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (lambda m, p: ({"w": torch.zeros(2)}, p), r"save_checkpoint\(model=...\) got a dict, not an nn.Module: pass"),
        (lambda m, p: (m, None), r"checkpoint_id=None\) must be a directory path .*pass e.g. 'checkpoints/step_100'"),
        (lambda m, p: (m, 7), r"checkpoint_id=7\) must be a directory path"),
        (lambda m, p: (m, b"ckpt"), r"checkpoint_id=b'ckpt'\) must be a directory path"),
        (lambda m, p: (m, ""), r"checkpoint_id=''\) must be a directory path \(a non-empty str"),
        (lambda m, p: (m, p, "adamw"), r"optimizer=...\) got a str: it must be None, a torch.optim.Optimizer"),
        (lambda m, p: (m, p, [torch.optim.SGD(m.parameters(), lr=0.1), 3]), r"got a list holding a int: it must"),
    ],
    ids=["dict", "none", "int", "bytes", "empty", "str-optimizer", "list-with-int"],
)
def test_save_checkpoint_arguments_of_the_wrong_kind_raise_checkpoint_error(tmp_path, args, match):
    """``save_checkpoint(dict, ...)`` raised a raw AttributeError, ``(model, None)`` a TypeError."""
    path = str(tmp_path / "ckpt")
    with _inproc.single_thread():
        model = _sharded()
        with pytest.raises(CheckpointError, match=match):
            save_checkpoint(*args(model, path))
        assert not os.path.exists(path)  # nothing written
        save_checkpoint(model, tmp_path / "ckpt", [torch.optim.SGD(model.parameters(), lr=0.1)])  # control: PathLike
        assert describe_checkpoint(path)["complete"]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (lambda m, p: ({"w": torch.zeros(2)}, p), r"load_checkpoint\(model=...\) got a dict, not an nn.Module"),
        (lambda m, p: (m, None), r"load_checkpoint\(checkpoint_id=None\) must be a directory path"),
        (lambda m, p: (m, p, "adamw"), r"load_checkpoint\(optimizer=...\) got a str"),
    ],
    ids=["dict", "none", "str-optimizer"],
)
def test_load_checkpoint_arguments_of_the_wrong_kind_raise_checkpoint_error(tmp_path, args, match):
    """``load_checkpoint(dict, ...)`` raised a raw AttributeError, ``(model, None)`` a TypeError."""
    path = str(tmp_path / "ckpt")
    with _inproc.single_thread():
        model = _sharded()
        save_checkpoint(model, path)
        with pytest.raises(CheckpointError, match=match):
            load_checkpoint(*args(model, path))
        load_checkpoint(model, tmp_path / "ckpt")  # the control: a PathLike
