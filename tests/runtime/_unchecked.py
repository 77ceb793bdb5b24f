"""``unchecked()``: the first-step optimizer checks off (``BLOCKSHARD_OPTIMIZER_CHECKS=0``) for a
control that runs what they refuse (Muon on row stripes, 8-bit state on pieces below
``min_8bit_size``, param_groups by the pieces' ndim), to show what unchecked sharding computes.
Spawned ranks set it in their own process; thread ranks share one environment (set it alike)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from blockshard.runtime.core._optim_checks import CHECKS_ENV


@contextlib.contextmanager
def unchecked(off: bool = True) -> Iterator[None]:
    before = os.environ.get(CHECKS_ENV)
    os.environ[CHECKS_ENV] = "0" if off else "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CHECKS_ENV, None)
        else:
            os.environ[CHECKS_ENV] = before
