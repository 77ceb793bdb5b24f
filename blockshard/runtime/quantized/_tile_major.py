"""Row-major <-> tile-major permutations of a ``B x B``-tiled weight ([Note: tile-major order] in
``blockshard/semantics/_tiles.py``).

:func:`to_tile_major` flattens a weight into its four parts (full tiles, right edge, bottom edge,
corner), each tile row-major within itself; :func:`from_tile_major` writes such a flattening back
into a row-major tensor (into ``out`` when given: the full weight a dequantization or an
all-gather fills anyway). Both are one strided copy per part, views elsewhere.
"""

from __future__ import annotations

import torch

from blockshard.semantics._tiles import tile_parts

__all__ = ["from_tile_major", "to_tile_major"]


def _dims(shape: tuple[int, ...], stacked: bool) -> tuple[int, int, int]:
    if stacked:
        e, r, c = shape
        return e, r, c
    r, c = shape
    return 1, r, c


def _regions(w3: torch.Tensor, tile: int) -> dict[str, torch.Tensor]:
    """Views of the parts' regions of ``w3`` ``(E, R, C)``, each shaped in its part's tile order."""
    _, r, c = w3.shape
    n_r, n_c = r // tile, c // tile
    hr, hc = n_r * tile, n_c * tile
    return {
        # (E, nR, nC, B, B): tile (i, j) of expert e at [e, i, j]
        "tiles": w3[:, :hr, :hc].unflatten(1, (n_r, tile)).unflatten(3, (n_c, tile)).permute(0, 1, 3, 2, 4),
        "right": w3[:, :hr, hc:].unflatten(1, (n_r, tile)),  # (E, nR, B, rc)
        "bottom": w3[:, hr:, :hc].unflatten(2, (n_c, tile)).permute(0, 2, 1, 3),  # (E, nC, rr, B)
        "corner": w3[:, hr:, hc:],  # (E, rr, rc)
    }


def to_tile_major(weight: torch.Tensor, tile: int, *, stacked: bool) -> torch.Tensor:
    """``weight``'s values in tile-major order, 1-D (a new tensor)."""
    shape = tuple(weight.shape)
    regions = _regions(weight.reshape(_dims(shape, stacked)), tile)
    parts = tile_parts(shape, tile, stacked=stacked)
    return torch.cat([regions[p.name].reshape(-1) for p in parts]) if parts else weight.reshape(-1).clone()


def from_tile_major(
    flat: torch.Tensor,
    shape: tuple[int, ...],
    tile: int,
    *,
    stacked: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The row-major ``shape`` tensor whose tile-major flattening is ``flat`` (written into ``out``,
    a contiguous tensor of that shape, when given)."""
    if out is None:
        out = torch.empty(shape, dtype=flat.dtype, device=flat.device)
    regions = _regions(out.view(_dims(shape, stacked)), tile)
    for p in tile_parts(shape, tile, stacked=stacked):
        dst = regions[p.name]
        dst.copy_(flat[p.offset : p.offset + p.numel].view(dst.shape))
    return out
