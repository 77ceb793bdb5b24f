"""tests/_shm.py: the removal of DeepSpeed's leaked shared-memory buffers ([Note: DeepSpeed's
shared-memory buffers]): unmapped old ones go, a mapped one and a fresh one stay."""

from __future__ import annotations

import mmap
import os
import time

import pytest
from _shm import remove_stale_deepspeed_buffers

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
