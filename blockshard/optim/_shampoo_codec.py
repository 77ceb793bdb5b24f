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

__all__ = ["ShampooBlocksCodec", "TileRows"]

_Tiling = Callable[[tuple[int, ...], int], list[tuple[int, ...]]]


class ShampooBlocksCodec:
    """The ``blocks`` state of ``BlockedShampoo`` (tiles of ``max_preconditioner_dim``).

    A piece of a tensor-parallel parameter ([Note: tiles across tp] in runtime/core/_optim_guard.py):
    its TP-local tiles are the global tensor's (the tp cut falls on a tile corner), so its entry is a
    piece of the global tensor's tiles, as boxes: one run under ``Shard(0)``, a run per tile row
    under ``Shard(1)``."""

    places_tp_pieces = True

    def __init__(self, tiles: _Tiling) -> None:
        self._tiles = tiles  # shape, tile size -> the dims of its tiles, row-major

    def encode(self, value: Any, piece: StatePiece, param_group: Mapping[str, Any]) -> object:
        d = param_group["max_preconditioner_dim"]
        blocks: list[dict[str, torch.Tensor]] = value
        local_tiles = self._tiles(piece.local_shape, d) if piece.numel else []
        if len(blocks) != len(local_tiles):
            raise AssertionError(f"{piece.name}: {len(blocks)} Shampoo blocks for {len(local_tiles)} tiles")
        first = self._first_tile(piece, d, local_tiles)
        tiles = self._tiles(piece.tp_shape or piece.shape, d)
        runs = self._global_runs(piece, d, first, local_tiles) if piece.tp_shape is not None else None
        out = {}
        for key in blocks[0] if blocks else ():
            slot = _key_shape(key, tiles[0])
            packed = torch.zeros((len(blocks), *slot), dtype=blocks[0][key].dtype, device=blocks[0][key].device)
            for i, block in enumerate(blocks):
                packed[i][tuple(slice(0, s) for s in block[key].shape)].copy_(block[key])
            boxes = None if runs is None else [((a, *(0 for _ in slot)), (n, *slot)) for a, n in runs]
            out[key] = PieceTensor(
                packed,
                first * math.prod(slot),
                (len(tiles), *slot),
                name=f"{piece.name}.blocks.{key}",
                process_group=piece.process_group,
                boxes=boxes,
            )
        return out

    def _global_runs(
        self, piece: StatePiece, d: int, first: int, local_tiles: list[tuple[int, ...]]
    ) -> list[tuple[int, int]]:
        """The piece's tiles (TP-local ``[first, first + len(local_tiles))``) as runs ``(start, count)``
        of the global tensor's tiles, in order; refused where the TP-local tiles are not global ones."""
        shape, offsets = piece.tp_shape or piece.shape, piece.tp_offsets or ()
        local = _matrix(piece.shape)
        whole = _matrix(shape)
        cut = [i for i, (a, b) in enumerate(zip(piece.shape, shape, strict=True)) if a != b]
        at = [0] * len(whole)  # where the TP-local matrix starts in the global one's 2-D (1-D) view
        if cut and cut[0] == 0:
            at[0] = offsets[0]
        elif cut and len(shape) == 2:
            at[1] = offsets[1]
        elif cut:  # a cut through the columns of a 3-D+ tensor's 2-D view: not a band of columns
            at = [-1] * len(whole)
        per = [-(-n // d) for n in local]  # tiles per dim of the TP-local view
        wper = [-(-n // d) for n in whole]
        g_tiles = self._tiles(shape, d)
        out: list[tuple[int, int]] = []
        for i in range(first, first + len(local_tiles)):
            pos = [i // per[1], i % per[1]] if len(per) == 2 else [i]
            g = [p + a // d for p, a in zip(pos, at, strict=True)]
            j = g[0] * wper[1] + g[1] if len(g) == 2 else g[0]
            if any(a < 0 or a % d for a in at) or not 0 <= j < len(g_tiles) or g_tiles[j] != local_tiles[i - first]:
                raise state_error(
                    piece.name,
                    "blocks",
                    f"holds BlockedShampoo tiles of a tensor-parallel piece (TP-local shape {piece.shape} at "
                    f"{offsets} of {shape}) that are not {d} x {d} tiles of the whole tensor",
                    f"a max_preconditioner_dim that divides the tp cut, or {SAME_W_FIX}",
                )
            if out and out[-1][0] + out[-1][1] == j:
                out[-1] = (out[-1][0], out[-1][1] + 1)
            else:
                out.append((j, 1))
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
        first = TileRows.of(shape, d).first(start)
        if first is None or self._tiles(shape, d)[first : first + len(local_tiles)] != local_tiles:
            raise state_error(
                piece.name,
                "blocks",
                f"holds BlockedShampoo tiles of a piece [{start}, {start + piece.numel}) that does not start at a "
                f"row of {d} x {d} tiles of the tensor of shape {shape}",
                f"shard this parameter with semantics='shampoo:{d}', or {SAME_W_FIX}",
            )
        return first


class TileRows:
    """BlockedShampoo's ``d x d`` tiles of a tensor, row-major over its 2-D view (runs of ``d`` for
    a 1-D one), seen from its flattening: a run of elements that starts at a tile row (``shampoo:D``
    cuts only there) holds a contiguous run of the tensor's tiles."""

    def __init__(self, d: int, row: int, per_row: int) -> None:
        self.d, self.row, self.per_row = d, row, per_row  # rows per tile, elements per row, tiles per tile row

    @classmethod
    def of(cls, shape: tuple[int, ...], d: int) -> TileRows:
        matrix = _matrix(shape)
        row = matrix[1] if len(matrix) == 2 else 1
        return cls(d, row, -(-row // d))

    def first(self, start: int) -> int | None:
        """The index of the tile a run starting at element ``start`` starts with (None: not at a tile row)."""
        stripe = self.d * self.row
        return start // stripe * self.per_row if start % stripe == 0 else None

    def count(self, start: int, end: int) -> int:
        """How many tiles the run of elements ``[start, end)`` (starting at a tile row) touches."""
        rows = -(-end // self.row) - start // self.row
        return -(-rows // self.d) * self.per_row


def _matrix(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The 2-D (1-D) view BlockedShampoo tiles: ``(shape[0], prod(shape[1:]))``."""
    return (math.prod(shape),) if len(shape) <= 1 else (shape[0], math.prod(shape[1:]))


def _key_shape(key: str, dims: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a tile's state ``key`` for a tile of ``dims``."""
    if key.startswith(("factor_", "inv_root_")):
        n = dims[int(key.rsplit("_", 1)[1])]
        return (n, n)
    return dims
