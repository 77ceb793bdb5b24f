"""Fixtures of the fast, in-process engine tier (see _inproc.py)."""

from __future__ import annotations

import _inproc
import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def gloo_w1():
    """A real gloo default group of one rank in the test process, for one test module, with one
    intra-op thread (bitwise comparisons); destroyed at the module's end."""
    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialized: a test leaked one")
    with _inproc.single_thread():
        tmp = _inproc.init_world1()
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()
            tmp.cleanup()
