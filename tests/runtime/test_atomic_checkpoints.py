"""A save killed midway leaves the previous checkpoint loadable (issue 11; [Note: atomic
checkpoints] in blockshard/runtime/_checkpoint_files.py), on spawned gloo ranks: rank 1 of 2 is
killed by SIGKILL during the second ``save_checkpoint`` into the same name, after writing its data
and before DCP's ``.metadata``; the launcher then kills rank 0 (bounded: ``TIMEOUT``, ``grace``).
Tolerance: bitwise (a load is a copy). Control: the partial directory the killed save left is
refused as a checkpoint."""

from __future__ import annotations

import os
import tempfile

import _atomic_runs as ar
import pytest
import torch

from blockshard._launch import spawn_gloo
from blockshard.runtime import CheckpointError, describe_checkpoint

pytestmark = pytest.mark.slow

TIMEOUT = 60


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable():
    root = tempfile.mkdtemp(prefix="blockshard-atomic-")
    path = os.path.join(root, "ckpt")
    with pytest.raises(RuntimeError, match="exited with code -9"):
        spawn_gloo(ar.killed_save, 2, args=(path,), timeout=TIMEOUT, grace=2.0)
    partial = os.path.join(root, ".ckpt.partial")
    assert sorted(f for f in os.listdir(partial) if f.endswith(".distcp"))  # the killed save had written data
    with pytest.raises(CheckpointError, match=r"has no \.metadata file"):
        describe_checkpoint(partial)
    info = describe_checkpoint(path)
    assert info["complete"] and info["world_size"] == 2
    first = torch.load(f"{path}-first.pt")
    (loaded,) = spawn_gloo(ar.load, 1, args=(path,), timeout=TIMEOUT)
    assert all(torch.equal(first[k], v) for k, v in loaded.items())
