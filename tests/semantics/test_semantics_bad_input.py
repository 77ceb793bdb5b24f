"""Bad input to the semantics layer (issue 9, point 6): every mistake a user can make is a SemanticsError or
ShapesError (ValueError subclasses) naming the thing, the value, the constraint and the fix; none relies on
``assert`` (one test reruns a case under ``python -O``)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest

from blockshard import BlockSemantics, Rule, SemanticsError, SemanticsRules, TensorSpec, UnitGrid
from blockshard._errors import ShapesError
from blockshard.semantics import (
    NO_ENTRY_POINTS_ENV,
    ByteSection,
    QuantizedStorage,
    SemanticsKind,
    _registry,
    get_semantics,
    registered_semantics,
)
from blockshard.semantics._registry import entry_points_disabled

W = TensorSpec(name="model.layers.0.mlp.up_proj.weight", shape=(96, 64))


class BadCuts(BlockSemantics):
    """A custom semantics whose grid is inconsistent: cuts that are not multiples of its unit."""

    def grid(self, shape, dtype, *, tensor="<tensor>"):
        return UnitGrid(math.prod(shape), 64, 100, 200)


class WrongNumel(BlockSemantics):
    def grid(self, shape, dtype, *, tensor="<tensor>"):
        return UnitGrid.units(math.prod(shape) + 1, 1)


class Crashes(BlockSemantics):
    def grid(self, shape, dtype, *, tensor="<tensor>"):
        return UnitGrid.units(math.prod(shape), shape[0] // 0)


def test_inconsistent_custom_grid_names_the_semantics_and_the_tensor():
    with pytest.raises(SemanticsError) as info:
        SemanticsRules.coerce(BadCuts()).resolve(W)
    msg = str(info.value)
    assert "semantics 'BadCuts' (BadCuts) on tensor 'model.layers.0.mlp.up_proj.weight' of shape (96, 64)" in msg
    assert "UnitGrid(numel=6144, unit_numel=64, min_cut=100, max_cut=200) is inconsistent" in msg
    assert "min_cut and max_cut must be multiples of unit_numel" in msg and "UnitGrid.units(numel, unit_numel)" in msg


def test_inconsistent_grid_is_refused_under_python_O():
    code = textwrap.dedent(
        """
        from blockshard import SemanticsError, UnitGrid
        assert False, "asserts are on"  # never reached under -O
        """
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr  # -O strips asserts: the control
    code = textwrap.dedent(
        """
        from blockshard import SemanticsError, UnitGrid
        for args in ((10, 0, 1, 1), (10, 4, 4, 12), (-1, 1, 1, 1), (10, 3, 2, 6)):
            try:
                UnitGrid(*args)
            except SemanticsError as e:
                print("refused", args)
        """
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("refused") == 4, out.stdout


def test_grid_of_the_wrong_size_names_the_semantics_and_the_fix():
    with pytest.raises(SemanticsError) as info:
        SemanticsRules.coerce(WrongNumel()).resolve(W)
    msg = str(info.value)
    assert "semantics 'WrongNumel'" in msg and "'model.layers.0.mlp.up_proj.weight'" in msg
    assert "grid() returned a grid of 6145 elements, not a UnitGrid of the tensor's 6144 elements" in msg
    assert "UnitGrid.units(math.prod(shape), unit_numel)" in msg


def test_grid_that_raises_names_the_semantics_and_the_tensor():
    with pytest.raises(SemanticsError) as info:
        SemanticsRules.coerce(Crashes()).resolve(W)
    msg = str(info.value)
    assert "semantics 'Crashes' (Crashes) on tensor 'model.layers.0.mlp.up_proj.weight'" in msg
    assert "grid() raised ZeroDivisionError: integer division or modulo by zero; fix the semantics" in msg


class _Quantizer(BlockSemantics):
    kind = SemanticsKind.QUANTIZER

    def grid(self, shape, dtype, *, tensor="<tensor>"):
        return UnitGrid.units(math.prod(shape), 64)


class StorageTooShort(_Quantizer):
    """Its payload section holds fewer bytes than its units need (a 4-bit format stated at 2 bits)."""

    def storage(self, shape, dtype):
        n = math.prod(shape)
        return QuantizedStorage("short", n, 64, (ByteSection("payload", n // 4, 32),))


class StorageNotAStorage(_Quantizer):
    def storage(self, shape, dtype):
        return {"payload": math.prod(shape) // 2}


def test_storage_whose_streams_do_not_fill_the_units_names_the_stream_and_the_fix():
    with pytest.raises(SemanticsError) as info:
        SemanticsRules.coerce(StorageTooShort()).resolve(W)
    msg = str(info.value)
    assert "semantics 'StorageTooShort' (StorageTooShort) on tensor 'model.layers.0.mlp.up_proj.weight'" in msg
    assert "section 'payload' of 1536 bytes at 32 bytes per unit does not fill 96 units of 64 values" in msg
    assert "Fix the semantics' storage()" in msg


def test_storage_of_the_wrong_type_names_the_semantics_and_the_fix():
    with pytest.raises(SemanticsError, match=r"storage\(\) returned \{'payload': 3072\}, not None or a Quantiz"):
        SemanticsRules.coerce(StorageNotAStorage()).resolve(W)


def test_unit_grid_units_refuses_a_zero_unit():
    with pytest.raises(SemanticsError, match=r"UnitGrid.units\(numel=16, unit_numel=0, min_piece=0\): unit_numel must"):
        UnitGrid.units(16, 0)


def test_a_semantics_callable_that_raises_is_wrapped_with_the_parameter():
    def pick(name, spec):
        raise KeyError("no rule for " + name)

    with pytest.raises(SemanticsError) as info:
        SemanticsRules.coerce(pick).resolve(W)
    msg = str(info.value)
    assert "semantics callable test_a_semantics_callable_that_raises_is_wrapped_with_the_parameter.<locals>.pick" in msg
    assert "raised on parameter 'model.layers.0.mlp.up_proj.weight' (shape (96, 64))" in msg
    assert "KeyError: 'no rule for model.layers.0.mlp.up_proj.weight'; fix the callable" in msg
    assert isinstance(info.value.__cause__, KeyError)


def test_a_semantics_callable_returning_a_bad_value_names_the_parameter():
    with pytest.raises(SemanticsError) as info:
        SemanticsRules.coerce(lambda name, spec: 5).resolve(W)
    msg = str(info.value)
    assert "returned 5 for parameter 'model.layers.0.mlp.up_proj.weight' (shape (96, 64))" in msg
    assert "Fix the callable" in msg


def test_a_rule_predicate_that_raises_is_wrapped_with_the_parameter():
    rule = Rule(semantics="nf4", predicate=lambda spec: spec.shape[5] > 0)
    with pytest.raises(SemanticsError) as info:
        SemanticsRules([rule]).resolve(W)
    msg = str(info.value)
    assert "Rule predicate" in msg and "raised on parameter 'model.layers.0.mlp.up_proj.weight'" in msg
    assert "IndexError" in msg and "fix the callable" in msg


def test_tensor_spec_refuses_dims_of_1e30():
    with pytest.raises(ShapesError) as info:
        TensorSpec(name="w", shape=(10**30, 4))
    msg = str(info.value)
    assert "tensor 'w': shape=(1000000000000000000000000000000, 4) has about 2**101 elements" in msg
    assert "more than the 281,474,976,710,656 (2**48)" in msg and "check the dims" in msg


@pytest.mark.parametrize(
    ("value", "disabled"),
    [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("false", False), ("No", False),
     ("off", False), ("", False)],
)  # fmt: skip
def test_no_entry_points_env_accepts_booleans(monkeypatch, value, disabled):
    monkeypatch.setenv(NO_ENTRY_POINTS_ENV, value)
    assert entry_points_disabled() is disabled


def test_no_entry_points_env_false_loads_plugins(monkeypatch):
    """``BLOCKSHARD_NO_ENTRY_POINTS=false`` used to turn plugins off (any non-empty value did)."""
    scans: list[str] = []
    monkeypatch.setattr(_registry, "entry_points", lambda *, group: scans.append(group) or [])
    monkeypatch.setattr(_registry, "_entry_points_loaded", False)
    monkeypatch.setenv(NO_ENTRY_POINTS_ENV, "false")
    registered_semantics()
    assert scans == ["blockshard.block_semantics"]


def test_no_entry_points_env_with_another_value_names_the_variable(monkeypatch):
    monkeypatch.setattr(_registry, "_entry_points_loaded", False)
    monkeypatch.setenv(NO_ENTRY_POINTS_ENV, "maybe")
    with pytest.raises(SemanticsError) as info:
        get_semantics("nf4")
    msg = str(info.value)
    assert "environment variable BLOCKSHARD_NO_ENTRY_POINTS='maybe' is not a boolean" in msg
    assert "set it to 1 (or true, yes, on) to skip plugins, or to 0 (or false, no, off, empty)" in msg


class Nf4Impostor(BlockSemantics):
    def grid(self, shape, dtype, *, tensor="<tensor>"):
        return UnitGrid.units(math.prod(shape), 3)


class _EntryPoint:
    name, value, dist = "nf4", "bs_evil:Nf4Impostor", None

    def load(self):
        return Nf4Impostor


def test_a_plugin_that_takes_a_built_in_name_raises_naming_both(monkeypatch):
    monkeypatch.setattr(_registry, "entry_points", lambda *, group: [_EntryPoint()])
    monkeypatch.setattr(_registry, "_entry_points_loaded", False)
    monkeypatch.delenv(NO_ENTRY_POINTS_ENV, raising=False)
    with pytest.raises(SemanticsError) as info:
        get_semantics("nf4")
    msg = str(info.value)
    assert "entry point 'nf4' = 'bs_evil:Nf4Impostor' in group 'blockshard.block_semantics'" in msg
    assert "registers Nf4Impostor under the name 'nf4', which blockshard.semantics._builtins.NF4" in msg
    assert "rename that entry point, or uninstall the plugin" in msg
    monkeypatch.setattr(_registry, "entry_points", lambda *, group: [])
    assert get_semantics("nf4").grid((64,), "bfloat16").unit_numel == 64  # the built-in is untouched
