"""How ``BlockedShampoo``'s per-tile state is checkpointed: the codec the checkpoint layer asks for
(``HasStateCodecs`` in blockshard/runtime/checkpoint/_optim_codecs.py, [Note: optimizer state codecs]).

``state[p]["blocks"]`` is a list of per-tile dicts, row-major over the piece's tiles. Per key it is
saved as a tensor of shape ``(tiles of S, *slot)`` where ``slot`` is that key's shape in the
largest tile (tile 0) and edge tiles sit zero-padded in their slot; a stripe of whole tile rows is
the flat run of its tiles, so the piece must start at a tile row (``shampoo:D`` semantics).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from blockshard.runtime.checkpoint._optim_codecs import SAME_W_FIX, StatePiece, state_error
from blockshard.runtime.checkpoint._piece_tensor import PieceTensor

__all__ = ["ShampooBlocksCodec"]

_Tiling = Callable[[tuple[int, ...], int], list[tuple[int, ...]]]


class ShampooBlocksCodec:
    """The ``blocks`` state of ``BlockedShampoo`` (tiles of ``max_preconditioner_dim``)."""

    def __init__(self, tiles: _Tiling) -> None:
        self._tiles = tiles  # shape, tile size -> the dims of its tiles, row-major

    def encode(self, value: Any, piece: StatePiece, param_group: Mapping[str, Any]) -> object:
        d = param_group["max_preconditioner_dim"]
        blocks: list[dict[str, torch.Tensor]] = value
        local_tiles = self._tiles(piece.local_shape, d) if piece.numel else []
        if len(blocks) != len(local_tiles):
            raise AssertionError(f"{piece.name}: {len(blocks)} Shampoo blocks for {len(local_tiles)} tiles")
        first = self._first_tile(piece, d, local_tiles)
        tiles = self._tiles(piece.shape, d)
        out = {}
        for key in blocks[0] if blocks else ():
            slot = _key_shape(key, tiles[0])
            packed = torch.zeros((len(blocks), *slot), dtype=blocks[0][key].dtype, device=blocks[0][key].device)
            for i, block in enumerate(blocks):
                packed[i][tuple(slice(0, s) for s in block[key].shape)].copy_(block[key])
            out[key] = PieceTensor(
                packed,
                first * math.prod(slot),
                (len(tiles), *slot),
                name=f"{piece.name}.blocks.{key}",
                process_group=piece.process_group,
            )
        return out

    def decode(self, saved: Any, live: Any, piece: StatePiece, param_group: Mapping[str, Any]) -> object:
        if not isinstance(saved, dict):
            return saved
        live = live if isinstance(live, list) else []
        local_tiles = self._tiles(piece.local_shape, param_group["max_preconditioner_dim"]) if piece.numel else []
        out = []
        for i, dims in enumerate(local_tiles):
            block = {}
            for key, packed in saved.items():
                slot = packed.shape[1:]
                local = packed.to_local() if isinstance(packed, PieceTensor) else packed.reshape(-1)
                tile = local.view(len(local_tiles), *slot)[i][tuple(slice(0, s) for s in _key_shape(key, dims))]
                dtype = live[i][key].dtype if i < len(live) and key in live[i] else tile.dtype
                block[key] = tile.to(dtype=dtype, copy=True)
            out.append(block)
        return out

    def _first_tile(self, piece: StatePiece, d: int, local_tiles: list[tuple[int, ...]]) -> int:
        """Index among the whole tensor's tiles of the piece's first tile (the piece's tiles must be
        the whole tensor's tiles ``[first, first + len(local_tiles))``)."""
        start, shape = piece.start, piece.shape
        row = math.prod(shape[1:]) if len(shape) >= 2 else 1
        tiles = self._tiles(shape, d)
        per_tile_row = len(self._tiles((d, row), d)) if len(shape) >= 2 else 1
        first = (start // row // d) * per_tile_row if start % (row * d) == 0 else -1
        if first < 0 or tiles[first : first + len(local_tiles)] != local_tiles:
            raise state_error(
                piece.name,
                "blocks",
                f"holds BlockedShampoo tiles of a piece [{start}, {start + piece.numel}) that does not start at a "
                f"row of {d} x {d} tiles of the tensor of shape {shape}",
                f"shard this parameter with semantics='shampoo:{d}', or {SAME_W_FIX}",
            )
        return first


def _key_shape(key: str, dims: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a tile's state ``key`` for a tile of ``dims``."""
    if key.startswith(("factor_", "inv_root_")):
        n = dims[int(key.rsplit("_", 1)[1])]
        return (n, n)
    return dims
