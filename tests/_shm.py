"""DeepSpeed's leaked shared-memory buffers, removed between test modules (tests/conftest.py).

[Note: DeepSpeed's shared-memory buffers]
Every DeepSpeed process on CPU (its TorchBackend's ``shm_comm_op``, deepspeed/ops/csrc/cpu/comm/shm.cpp)
creates a 69 MB ``/dev/shm/deepspeed_allreduce_buffer_<addr>_<port>_<rank>`` and never unlinks it. A
/dev/shm file is RAM: the suite's DeepSpeed launches left gigabytes of them, and a later test file ran
out of memory. After each test module, the buffers no live process maps (and older than a minute,
so a peer that is about to attach to a new one still finds it) are removed.

[Note: a stale extension build lock]
DeepSpeed builds its CPU ops (``deepspeed_shm_comm``) with torch's ``cpp_extension``, which holds
``<extensions dir>/<op>/lock`` while one process builds and makes every other process wait for it to
go. A build killed midway (a test's timeout) leaves the lock behind, and every later DeepSpeed launch
on that machine waits forever. At the start of a test session, a lock older than any build (ten
minutes; a build takes under one) is removed.
"""

from __future__ import annotations

import glob
import os
import time

_SHM = "/dev/shm"
_DS_BUFFER = "deepspeed_allreduce_buffer_"


def _mapped_shm() -> set[str]:
    mapped = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                mapped.update(line.split()[-1] for line in f if _DS_BUFFER in line)
        except OSError:
            continue  # gone, or not ours to read
    return mapped


def remove_stale_deepspeed_buffers(min_age_s: float = 60.0) -> int:
    """Remove DeepSpeed's leaked shared-memory buffers that no live process maps; how many."""
    if not os.path.isdir(_SHM):
        return 0
    stale = [f for f in os.listdir(_SHM) if f.startswith(_DS_BUFFER)]
    if not stale:
        return 0
    mapped, now, removed = _mapped_shm(), time.time(), 0
    for name in stale:
        path = os.path.join(_SHM, name)
        try:
            if path not in mapped and now - os.path.getmtime(path) > min_age_s:
                os.unlink(path)
                removed += 1
        except OSError:
            continue
    return removed


def _extensions_dir() -> str:
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")


def remove_stale_extension_locks(root: str | None = None, min_age_s: float = 600.0) -> int:
    """Remove build locks of DeepSpeed's ops older than ``min_age_s``; how many."""
    root = root or _extensions_dir()
    now, removed = time.time(), 0
    for lock in glob.glob(os.path.join(root, "*", "deepspeed_*", "lock")) + glob.glob(
        os.path.join(root, "deepspeed_*", "lock")
    ):
        try:
            if now - os.path.getmtime(lock) > min_age_s:
                os.unlink(lock)
                removed += 1
        except OSError:
            continue
    return removed
