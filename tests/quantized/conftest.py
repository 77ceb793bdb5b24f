"""The quantized tests reuse the engine tier's in-process ranks (tests/runtime/_inproc.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "runtime"))


@pytest.fixture(scope="module")
def gloo_w1():
    """A real gloo default group of one rank in the test process for one test module (as
    tests/runtime/conftest.py's), with one intra-op thread; destroyed at the module's end."""
    import _inproc

    with _inproc.world1() as group:
        yield group


def pytest_collection_modifyitems(config, items):
    """Each parametrized test of a ``test_fast_*`` file keeps its first case in ``make test-fast``;
    the rest of its matrix (formats x storage x world sizes) is marked ``heavy`` (in process, but
    seconds each), so `make test-fast` stays under a minute while every case still runs in
    `make test`."""
    first: set[tuple[str, str]] = set()
    for item in items:
        callspec = getattr(item, "callspec", None)
        here = item.path.parent == Path(__file__).resolve().parent  # the hook sees every folder's items
        if callspec is None or not here or not item.path.name.startswith("test_fast_"):
            continue
        key = (str(item.path), item.originalname)
        if key in first:
            item.add_marker(pytest.mark.heavy)
        else:
            first.add(key)
