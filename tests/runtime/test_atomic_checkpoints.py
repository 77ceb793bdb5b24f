"""A save killed midway leaves the previous checkpoint loadable (issue 11; [Note: atomic
checkpoints] in blockshard/runtime/checkpoint/_files.py), on spawned gloo ranks: rank 1 of 2 is
killed by SIGKILL during the second ``save_checkpoint`` into the same name, after writing its data
and before DCP's ``.metadata``; the launcher then kills rank 0 (bounded: ``TIMEOUT``, ``grace``).
Tolerance: bitwise (a load is a copy). The partial directory the killed save left is
removed by the surviving rank (its save failed when the peer died)."""

from __future__ import annotations

import os
import tempfile

import _atomic_runs as ar
import pytest
import torch

from blockshard._launch import spawn_gloo
from blockshard.runtime import describe_checkpoint

pytestmark = pytest.mark.slow

TIMEOUT = 60


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable():
    root = tempfile.mkdtemp(prefix="blockshard-atomic-")
    path = os.path.join(root, "ckpt")
    with pytest.raises(RuntimeError, match="exited with code -9"):
        spawn_gloo(ar.killed_save, 2, args=(path,), timeout=TIMEOUT, grace=2.0)
    # rank 0's save failed when its peer died (gloo closed the pair), and it removed the partial
    # directory; a partial directory a kill of every rank leaves is refused as a checkpoint
    # (test_fast_checkpoint_files.py)
    assert sorted(os.listdir(root)) == ["ckpt", "ckpt-first.pt"]
    info = describe_checkpoint(path)
    assert info["complete"] and info["world_size"] == 2
    first = torch.load(f"{path}-first.pt")
    (loaded,) = spawn_gloo(ar.load, 1, args=(path,), timeout=TIMEOUT)
    assert all(torch.equal(first[k], v) for k, v in loaded.items())
