"""The lookup tables are read-only: mutating one would change every later plan in the process."""

from __future__ import annotations

import pytest

from blockshard.optim import OPTIMIZER_SEMANTICS
from blockshard.semantics import DTYPE_ITEMSIZE, PRESETS
from blockshard.semantics._spec import _DTYPE_ALIASES


@pytest.mark.parametrize("table", [DTYPE_ITEMSIZE, _DTYPE_ALIASES, PRESETS, OPTIMIZER_SEMANTICS])
def test_tables_refuse_writes(table):
    key = next(iter(table))
    with pytest.raises(TypeError):
        table[key] = table[key]
    with pytest.raises(AttributeError):
        table.pop(key)
    assert key in table  # control: the key is there to be written


def test_tables_still_read_as_before():
    assert DTYPE_ITEMSIZE["bfloat16"] == 2 and OPTIMIZER_SEMANTICS["muon"] == "matrix"
    assert sorted(PRESETS) == ["adamw", "muon"]
