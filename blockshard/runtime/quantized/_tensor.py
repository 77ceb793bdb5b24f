"""One frozen quantized tensor as its buffer set sees it: byte sections and the rebuilt parameter.

A format adapter (``_bnb4bit.py``, ``_ao_nf4.py``) turns a quantized parameter into a
:class:`QuantizedTensor`: its byte sections on one unit grid ([Note: quantized layout]), the
original bytes to shard (``sources``, dropped once copied into the local segment), persistent
gathered tensors (``gathered``, their storage freed while sharded) with byte views of them
(``targets``), and ``unsharded``: the format's own parameter over the gathered tensors, what the
module holds during forward and backward. Its state-dict entries (``entries``, ``to_full``,
``from_full``) are described in [Note: quantized state dicts] (``_quantized_state.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeAlias

import torch
from torch import nn

from blockshard.runtime.core._param import ParamRef
from blockshard.runtime.quantized._layout import SectionShape
from blockshard.runtime.quantized._tile_major import TileOrder

__all__ = ["QuantizedTensor", "SharedConstants", "StateEntry", "byte_view"]

#: A group's constants shared by its quantized tensors (code tables), keyed by what identifies one
#: (its dtype, shape and bytes: each adapter builds its own key).
SharedConstants: TypeAlias = dict[tuple[object, ...], torch.Tensor]


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat ``uint8`` tensor (no copy, no float canonicalization)."""
    if t.dtype == torch.uint8:
        return t.reshape(-1)
    return t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


@dataclass(frozen=True)
class StateEntry:
    """One state-dict entry of a quantized tensor, named relative to the module that holds the weight
    (``"weight"``, ``"weight.absmax"``, ``"weight_scale_inv"``): byte section ``section`` seen as a
    tensor of ``dtype`` and ``shape`` (sharded), or a replicated ``constant`` (``section`` None)."""

    name: str
    section: int | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    constant: torch.Tensor | None = None


@dataclass(eq=False)
class QuantizedTensor:
    fqn: str  # name relative to the sharded module
    refs: list[ParamRef]
    format: str  # e.g. "bitsandbytes nf4 (nested absmax, bf16 storage)"
    numel: int  # quantized values
    n_units: int
    sections: tuple[SectionShape, ...]
    sources: list[torch.Tensor]  # byte views of the original tensors, one per section
    gathered: list[torch.Tensor]  # persistent full tensors, one per section (storage freed while sharded)
    targets: list[torch.Tensor]  # byte views of ``gathered``
    unsharded: nn.Parameter  # the format's parameter over ``gathered``
    constant_bytes: int = 0  # replicated per-tensor constants (code tables, offsets)
    # parameters of their own that travel with this one (blockwise FP8's ``weight_scale_inv``):
    # (where registered, the unsharded parameter over a gathered tensor)
    extra: list[tuple[list[ParamRef], nn.Parameter]] = field(default_factory=list)
    # state-dict entries ([Note: quantized state dicts]): the sharded model's (sections as pieces,
    # constants), and the unsharded model's names with functions between them and the full sections
    entries: list[StateEntry] = field(default_factory=list)
    full_names: tuple[str, ...] = ()  # the unsharded model's entries (default: ``entries``' names)
    to_full: Callable[[list[torch.Tensor]], dict[str, torch.Tensor]] | None = None
    from_full: Callable[[dict[str, torch.Tensor]], list[torch.Tensor]] | None = None
    # tile-placed ([Note: tile placement in the engine] in _frozen.py): sections 0 (the payload) and 1
    # (one fp32 scale per tile) in this tile-major order; None: in the row-major order of the tensor
    tiles: TileOrder | None = None
    sharded: nn.Parameter = field(init=False, repr=False)  # this rank's payload bytes (frozen)
    extra_sharded: list[nn.Parameter] = field(default_factory=list, repr=False)  # empty, frozen

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sections)

    def _rows(self, k: int, flat: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Section ``k`` (a whole, flat ``uint8`` tensor) in its row-major shape, and its bytes per value."""
        assert self.tiles is not None
        if k == 0:
            return flat.view(self.tiles.shape), 1
        return flat.view(torch.int32).view(self.tiles.grid_shape), 4

    def put_section(self, k: int, dst: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> None:
        """Write ``src``, bytes ``[lo, hi)`` of section ``k`` in this tensor's order, into ``dst``
        (the whole section, flat ``uint8``, row-major)."""
        if self.tiles is None:
            dst[lo:hi].copy_(src)
            return
        rows, size = self._rows(k, dst)
        if k == 0:
            self.tiles.put(rows, src, *self.tiles.tile_range(lo, hi))
        else:
            aligned = src if src.storage_offset() % size == 0 else src.clone()
            self.tiles.put_scales(rows, aligned.view(torch.int32), lo // size)

    def take_section(self, k: int, full: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Bytes ``[lo, hi)`` of section ``k`` in this tensor's order, from ``full`` (the whole
        section, flat ``uint8``, row-major)."""
        if self.tiles is None:
            return full[lo:hi]
        rows, size = self._rows(k, full)
        if k == 0:
            return self.tiles.take(rows, *self.tiles.tile_range(lo, hi))
        return self.tiles.take_scales(rows, lo // size, hi // size).view(torch.uint8)

    def set_module_params(self, unsharded: bool) -> None:
        for ref in self.refs:
            ref.set(self.unsharded if unsharded else self.sharded)
        for i, (refs, full) in enumerate(self.extra):
            for ref in refs:
                ref.set(full if unsharded else self.extra_sharded[i])
