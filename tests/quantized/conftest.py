"""The quantized tests reuse the engine tier's in-process ranks (tests/runtime/_inproc.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "runtime"))


@pytest.fixture(scope="module")
def gloo_w1():
    """A real gloo default group of one rank in the test process for one test module (as
    tests/runtime/conftest.py's), with one intra-op thread; destroyed at the module's end."""
    import _inproc

    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialized: a test leaked one")
    with _inproc.single_thread():
        tmp = _inproc.init_world1()
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()
            tmp.cleanup()
