"""Atomic checkpoint directories and their record, in-process (issue 11; the save killed by
SIGKILL on spawned ranks is in test_atomic_checkpoints.py): ``save_checkpoint`` at W = 2 (threads)
records world size, groups, layouts and semantics for ``describe_checkpoint`` / ``blockshard
inspect``; a save that fails midway leaves the previous checkpoint loadable and its partial
directory is removed (a killed save's is never taken for a checkpoint); a save killed between its two renames loads the
moved-aside previous checkpoint.
Tolerance: bitwise (copies). Controls: the second save's values differ from the first's; the
partial directory is reported incomplete."""

from __future__ import annotations

import os
import shutil

import _inproc
import pytest
import torch
from _ckpt_models import sharded_odd_mlp as _sharded
from torch import nn

import blockshard
from blockshard._tiny import mlp_batches
from blockshard.cli import main
from blockshard.runtime import CheckpointError, describe_checkpoint, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _w1(gloo_w1):
    return gloo_w1


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x, y = mlp_batches(1, 4)[0]
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _save_w2(rank: int, world: int, path: str) -> None:
    model = _sharded(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt)
    save_checkpoint(model, path, opt)


def test_a_checkpoint_records_world_size_groups_layouts_and_semantics(tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    _inproc.run_ranks(_save_w2, 2, args=(path,))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no partial or old directory left
    info = describe_checkpoint(path)
    assert info["complete"] and info["world_size"] == 2 and info["ranks_that_wrote"] == 2
    assert info["saved_by"] == "blockshard.save_checkpoint" and info["blockshard_version"] == blockshard.__version__
    assert info["optimizers"] == ["torch.optim.adamw.AdamW"]
    groups = {g["module"]: g for g in info["groups"]}
    assert set(groups) == {"blocks.0", "blocks.1", "blocks.2"}  # the root holds no parameter
    assert groups["blocks.0"]["world_size"] == 2 and groups["blocks.0"]["semantics"] == {"bnb8bit": 4}
    weight = next(t for t in groups["blocks.0"]["tensors"] if t["name"] == "blocks.0.0.weight")
    assert weight["shape"] == [37, 13] and sum(n for _, _, n in weight["pieces"]) == 37 * 13
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "world size 2" in out and "group blocks.0 (Sequential)" in out and "bnb8bit" in out


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    path = str(tmp_path / "ckpt")
    with _inproc.single_thread():
        model = _sharded(0)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        _step(model, opt)
        save_checkpoint(model, path, opt)
        first = blockshard.full_state_dict(model)
        _step(model, opt)
        assert not all(torch.equal(first[k], v) for k, v in blockshard.full_state_dict(model).items())  # control
        write = FileSystemWriter.write_data

        partial = str(tmp_path / ".kept.partial")

        def dies_after_writing(self, plan, planner):
            write(self, plan, planner).wait()
            shutil.copytree(self.path, partial)  # what a kill would leave: data, no .metadata
            raise KeyboardInterrupt("killed after writing its data")

        monkeypatch.setattr(FileSystemWriter, "write_data", dies_after_writing)
        with pytest.raises(CheckpointError, match="killed after writing its data"):
            save_checkpoint(model, path, opt)
        monkeypatch.undo()
        assert not os.path.exists(tmp_path / ".ckpt.partial")  # a save that raised removes what it wrote
        assert describe_checkpoint(path)["complete"]
        with pytest.raises(CheckpointError, match=r"has no \.metadata file"):
            describe_checkpoint(partial)
        resumed = _sharded(1)
        load_checkpoint(resumed, path, torch.optim.AdamW(resumed.parameters(), lr=0.1))
        assert all(torch.equal(first[k], v) for k, v in blockshard.full_state_dict(resumed).items())
        alone = _sharded(2)
        load_checkpoint(alone, path)  # the model alone from a checkpoint with optimizer state
        assert all(torch.equal(first[k], v) for k, v in blockshard.full_state_dict(alone).items())
        os.rename(partial, tmp_path / ".ckpt.partial")
        save_checkpoint(model, path, opt)  # the next save replaces the leftovers
        assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_save_killed_between_its_renames_loads_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    with _inproc.single_thread():
        model = _sharded(0)
        save_checkpoint(model, path)
        os.rename(path, tmp_path / ".ckpt.old")  # the state after the first rename
        os.makedirs(tmp_path / ".ckpt.partial")
        resumed = _sharded(1)
        load_checkpoint(resumed, path)
        want = blockshard.full_state_dict(model)
        assert all(torch.equal(want[k], v) for k, v in blockshard.full_state_dict(resumed).items())
        os.makedirs(tmp_path / ".ckpt.partial" / "x")
        with open(tmp_path / ".ckpt.partial" / ".metadata", "wb"):
            pass  # DCP finished but the record is missing: never complete
        with pytest.raises(CheckpointError):
            load_checkpoint(resumed, str(tmp_path / ".ckpt.partial"))


def test_a_second_kill_between_the_renames_still_leaves_the_first_checkpoint(tmp_path, monkeypatch):
    """A save killed between its renames leaves only ``.ckpt.old``; the next save puts it back
    before moving it aside, so a kill at the same point again still leaves it loadable."""
    path = str(tmp_path / "ckpt")
    with _inproc.single_thread():
        model = _sharded(0)
        save_checkpoint(model, path)
        want = blockshard.full_state_dict(model)
        os.rename(path, tmp_path / ".ckpt.old")  # the state after the first rename of a killed save
        real = os.rename

        def killed(src, dst):
            if str(src).endswith(".ckpt.partial"):
                raise KeyboardInterrupt("killed between the renames")
            real(src, dst)

        monkeypatch.setattr(os, "rename", killed)
        with pytest.raises(KeyboardInterrupt):
            save_checkpoint(_sharded(1), path)
        monkeypatch.setattr(os, "rename", real)
        resumed = _sharded(2)
        load_checkpoint(resumed, path)
        assert all(torch.equal(want[k], v) for k, v in blockshard.full_state_dict(resumed).items())
