"""tests/_shm.py: the removal of DeepSpeed's leaked shared-memory buffers ([Note: DeepSpeed's
shared-memory buffers]): unmapped old ones go, a mapped one and a fresh one stay; and of a stale
build lock ([Note: a stale extension build lock]): an old one goes, a fresh one stays."""

from __future__ import annotations

import mmap
import os
import time

import pytest
from _shm import remove_stale_deepspeed_buffers, remove_stale_extension_locks

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this system")


def _buffer(tag: str, age_s: float) -> str:
    path = f"/dev/shm/deepspeed_allreduce_buffer_test_{os.getpid()}_{tag}"
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def test_unmapped_old_buffers_are_removed_mapped_and_fresh_ones_kept():
    stale, fresh, mapped = _buffer("stale", 600), _buffer("fresh", 0), _buffer("mapped", 600)
    with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 4096) as _:
        try:
            assert remove_stale_deepspeed_buffers() >= 1
            assert not os.path.exists(stale)
            assert os.path.exists(fresh) and os.path.exists(mapped)
        finally:
            for path in (stale, fresh, mapped):
                if os.path.exists(path):
                    os.unlink(path)


def test_an_old_extension_build_lock_is_removed_a_fresh_one_kept(tmp_path):
    old_lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    fresh_lock = tmp_path / "py311_cpu" / "deepspeed_other_op" / "lock"
    other = tmp_path / "py311_cpu" / "someone_elses_op" / "lock"
    for path in (old_lock, fresh_lock, other):
        path.parent.mkdir(parents=True)
        path.write_text("")
    old = time.time() - 3600
    os.utime(old_lock, (old, old))
    os.utime(other, (old, old))
    assert remove_stale_extension_locks(str(tmp_path)) == 1
    assert not old_lock.exists()
    assert fresh_lock.exists() and other.exists()
