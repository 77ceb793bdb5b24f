"""``tile96``: a block semantics for a (made-up) quantizer that scales runs of 96 elements.

A shard boundary may fall only between whole 96-element tiles of a tensor (a shorter last tile is
allowed), so each rank can quantize its own tiles and get what one process gets. blockshard finds
this class through the ``blockshard.block_semantics`` entry point in ``pyproject.toml``; no
``register_semantics`` call or import is needed in the training script.
"""

from __future__ import annotations

import math

from blockshard import BlockSemantics, UnitGrid

__all__ = ["TILE_NUMEL", "Tile96"]

TILE_NUMEL = 96


class Tile96(BlockSemantics):
    """Units of 96 consecutive elements of the flattened tensor (placement and compute)."""

    def grid(self, shape: tuple[int, ...], dtype: str, *, tensor: str = "<tensor>") -> UnitGrid:
        return UnitGrid.units(math.prod(shape), TILE_NUMEL)
