"""Entry-point loading in-process: a broken plugin fails every lookup (naming it and the fix) until it is
fixed or skipped; a good one loads once. ``entry_points`` is faked where the registry looks it up."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from blockshard import BlockSemantics, SemanticsError, UnitGrid
from blockshard.semantics import NO_ENTRY_POINTS_ENV, _registry, get_semantics, registered_semantics


@dataclass
class FakeEntryPoint:
    name: str
    value: str
    loader: Callable[[], object]

    def load(self) -> object:
        return self.loader()


class Tile9(BlockSemantics):
    def grid(self, shape, dtype, *, tensor="<tensor>"):
        return UnitGrid.units(math.prod(shape), 9)


def _missing_module() -> object:
    raise ModuleNotFoundError("No module named 'bs_gone'")


BROKEN = FakeEntryPoint("gone", "bs_gone:Tile", _missing_module)
GOOD = FakeEntryPoint("tile9", "bs_plugin:Tile9", lambda: Tile9)


@pytest.fixture
def plugins(monkeypatch):
    """The entry points the registry will see (a list to fill); counts the scans."""
    installed: list[FakeEntryPoint] = []
    scans: list[str] = []

    def entry_points(*, group):
        scans.append(group)
        return list(installed)

    monkeypatch.setattr(_registry, "entry_points", entry_points)
    monkeypatch.setattr(_registry, "_entry_points_loaded", False)
    monkeypatch.delenv(NO_ENTRY_POINTS_ENV, raising=False)
    yield installed, scans
    _registry.unregister_semantics("tile9")


def test_a_broken_plugin_fails_every_lookup_naming_it_and_the_fix(plugins):
    installed, _ = plugins
    installed.append(BROKEN)
    for lookup in (lambda: get_semantics("nf4"), lambda: get_semantics("nf4"), registered_semantics):
        with pytest.raises(SemanticsError) as info:
            lookup()
        msg = str(info.value)
        assert "entry point 'gone' = 'bs_gone:Tile'" in msg and "blockshard.block_semantics" in msg
        assert "No module named 'bs_gone'" in msg
        assert f"set {NO_ENTRY_POINTS_ENV}=1 to skip plugins" in msg


def test_fixing_the_plugin_or_skipping_plugins_recovers(plugins, monkeypatch):
    installed, _ = plugins
    installed.append(BROKEN)
    with pytest.raises(SemanticsError, match="'gone'"):
        get_semantics("nf4")
    monkeypatch.setenv(NO_ENTRY_POINTS_ENV, "1")
    assert get_semantics("nf4").spec == "nf4"  # skipped: the built-ins still work
    monkeypatch.delenv(NO_ENTRY_POINTS_ENV)
    with pytest.raises(SemanticsError, match="'gone'"):  # not skipped any more: still broken
        get_semantics("nf4")
    installed[:] = [GOOD]  # the package is fixed: the next lookup loads it, no reload needed
    assert get_semantics("tile9").grid((2, 9), "float32") == UnitGrid.units(18, 9)


def test_good_plugins_load_once(plugins):
    installed, scans = plugins
    installed.append(GOOD)
    assert "tile9" in registered_semantics()
    assert isinstance(get_semantics("tile9"), Tile9) and Tile9.name_of() == "tile9"
    get_semantics("nf4")
    assert scans == ["blockshard.block_semantics"]
    _registry.reload_entry_points()
    assert len(scans) == 2


def test_a_plugin_that_looks_up_semantics_while_loading_sees_the_built_ins(plugins):
    installed, scans = plugins

    def load() -> object:
        assert get_semantics("nf4").spec == "nf4"  # re-entrant lookup: no second scan, no recursion
        return Tile9

    installed.append(FakeEntryPoint("tile9", "bs_plugin:Tile9", load))
    assert get_semantics("tile9").spec == "tile9"
    assert scans == ["blockshard.block_semantics"]
