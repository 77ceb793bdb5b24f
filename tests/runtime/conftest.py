"""Fixtures of the fast, in-process engine tier (see _inproc.py)."""

from __future__ import annotations

import _inproc
import pytest


@pytest.fixture(scope="module")
def gloo_w1():
    """A real gloo default group of one rank in the test process, for one test module, with one
    intra-op thread (bitwise comparisons); destroyed at the module's end."""
    with _inproc.world1() as group:
        yield group
