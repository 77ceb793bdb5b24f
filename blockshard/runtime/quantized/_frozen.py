"""``FrozenQuantizedBuffers``: the frozen quantized weights of one ``fully_shard`` call, sharded as bytes.

[Note: frozen quantized buffers]
Beside its float :class:`~blockshard.runtime.core._buffers.ParamBuffers`, a ``fully_shard`` call gives the
frozen quantized weights of its module (bitsandbytes ``Params4bit``, torchao ``NF4Tensor`` and ``MXTensor``; see
``_tensor.py`` for the format adapters) a buffer set of their own, laid out by whole quantization units
([Note: quantized layout] in ``_layout.py``), the first of the group's buffer sets ([Note: buffer sets]):
  * ``local``  uint8 [S]: the persistent segment, every held unit's payload with its companions
    (absmax, nested absmax) — no rank holds another rank's scales;
  * a transient uint8 [W * S]: the all-gather's output, alive from the unshard to its wait;
  * per tensor, persistent gathered tensors (payload, absmax, ...), filled from the transient buffer
    at the wait and freed (storage resized to 0) at the reshard; the format's parameter over them
    (a ``Params4bit`` with its quant state) is what the module holds during forward and backward.
    They are the same objects every step, so autograd's saved references (``MatMul4Bit`` keeps the
    weight for the input gradient) stay valid and are refilled by the pre-backward unshard.
The module's state drives it as every buffer set: its unshard issues this all-gather (async, so
prefetch covers it), its wait finishes it, its reshard frees it. Between forwards the module holds a
frozen ``uint8`` parameter viewing this rank's payload bytes of the tensor (empty where the rank
holds none).
No gradients, no reduce-scatter, no optimizer state: these weights never change.

[Note: tile placement in the engine]
``fully_shard(..., tile_placement=True)`` places a frozen blockwise-FP8 weight ``(R, C)`` (or stacked
``(E, R, C)`` experts, tiled per expert) in ``Br x Bc`` tiles by **whole tiles** rather than by
``Br``-row stripes ([Note: tile-major order] in ``semantics/_tiles.py`` says why stripes pad 50-82%
at W >= 256). Its units are its tiles in tile-major order (full tiles, right edge, bottom edge,
corner: ``SectionShape.runs``), each unit its payload bytes and its fp32 scale, so a rank's piece
is any run of whole tiles and the cut falls at most one tile from the ideal one (``plan_quantized``
is unchanged). What moves and what
stays:
  * the segment holds a run's payload in tile-major order, then its scales in the same order;
  * the all-gather is the same bytes; the wait, which copies each rank's bytes out of the
    transient buffer into the persistent gathered tensors anyway, writes them at their row-major
    places (``TileOrder.put`` / ``put_scales``: one indexed copy per part), so the module computes
    on the same row-major ``weight`` and ``weight_scale_inv`` as under stripes: **no extra copy**;
  * state dicts: ``model.state_dict()``'s entries are PieceTensors of the global shapes whose
    pieces are boxes of whole tiles (``TileOrder.boxes``: per part the start of a tile row, whole
    tile rows, the end of one), their values copied box by box, so DCP saves and reshards them as
    any entry, between world sizes *and* between placements (a stripe checkpoint loads tile-placed
    and back); ``blockshard.sharded_state_dict``'s ``LocalShard`` holds the run in tile-major order
    and says so (``order="tile-major 128 x 128"``: a row-major piece is refused by name);
    ``full_state_dict`` and ``save_pretrained`` give the unsharded model's entries.
``plan_model(..., tile_placement=True)`` predicts these bytes per rank ([Note: planned tile
placement]); tests/planner/test_tile_placement.py checks both on random shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from blockshard._errors import ShardingError
from blockshard.runtime.core._buffer_set import BufferSet
from blockshard.runtime.core._collectives import all_gather_into, check_same_layout, holds_copies
from blockshard.runtime.core._common import ShardedState
from blockshard.runtime.core._inspect import BuffersView
from blockshard.runtime.core._param import ParamRef
from blockshard.runtime.core._state import ModuleState, state_of
from blockshard.runtime.quantized._ao_nf4 import ao_nf4_tensor, is_ao_nf4
from blockshard.runtime.quantized._bnb4bit import bnb_tensor, is_params4bit, prepare_module
from blockshard.runtime.quantized._fp8_block import fp8_block_pair, fp8_block_sections, fp8_block_tensor
from blockshard.runtime.quantized._layout import QuantizedLayout, QuantizedPiece, plan_quantized
from blockshard.runtime.quantized._mx import is_mx, mx_tensor
from blockshard.runtime.quantized._tensor import QuantizedTensor, SharedConstants

__all__ = [
    "Found",
    "FrozenQuantizedBuffers",
    "QuantizedStats",
    "collect_quantized",
    "frozen_buffers",
    "ignored_quantized",
    "quantized_stats",
]


def _adapter(param: nn.Parameter) -> Callable[..., QuantizedTensor] | None:

    if is_params4bit(param):
        return bnb_tensor
    if is_ao_nf4(param):
        return ao_nf4_tensor

    if is_mx(param):
        return mx_tensor
    return None


@dataclass
class Found:
    """A quantized parameter of a module's subtree: its name, where it is registered, the parameter
    and, for blockwise FP8, its scale parameter (name, place, parameter) and tile."""

    name: str
    refs: list[ParamRef]
    param: nn.Parameter
    scale: tuple[str, ParamRef, nn.Parameter] | None = None
    block: object = None  # the module's block_size, checked by the FP8 adapter

    @property
    def ids(self) -> set[int]:
        return {id(self.param)} | ({id(self.scale[2])} if self.scale else set())

    def build(self, constants: SharedConstants, *, tile_placement: bool = False) -> QuantizedTensor:
        if self.scale is not None:
            return fp8_block_tensor(
                self.name, self.refs, self.param, self.scale, self.block, tile_placement=tile_placement
            )
        adapter = _adapter(self.param)
        assert adapter is not None
        return adapter(self.name, self.refs, self.param, constants)


def _tiles_pad_less(
    found: list[Found], others: dict[int, QuantizedTensor], world_size: int, alignment_bytes: int
) -> bool:
    """``tile_placement="auto"``: whether placing the group's blockwise-FP8 weights by tiles gives a
    smaller segment than by stripes (ties: stripes). Stripes can pad less at small ``W`` (a stripe
    ends where a rank's share does, a tile run's scales are its own units); tiles win once ranks
    hold few stripes. Only the layouts are planned: no byte is copied for the one not taken."""

    def segment(tiles: bool) -> int:
        entries = []
        for i, f in enumerate(found):
            if f.scale is None:
                entries.append((others[i].sections, others[i].n_units))
            else:
                _, sections, n_units = fp8_block_sections(f.name, f.param, f.scale[2], f.block, tile_placement=tiles)
                entries.append((sections, n_units))
        return plan_quantized(entries, world_size, alignment_bytes).segment_bytes

    return segment(True) < segment(False)


def collect_quantized(module: nn.Module, ignored: set[int], is_sharded: Callable[[nn.Module], bool]) -> list[Found]:
    """The quantized parameters of ``module``'s subtree, not in a sharded submodule nor ignored, in
    ``named_modules`` order."""

    found: dict[int, Found] = {}
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        prefix, mod = stack.pop()
        if mod is not module and is_sharded(mod):
            continue
        pair = fp8_block_pair(mod, ignored)
        if pair is not None and id(pair[0]) not in found:
            weight, scale, block = pair
            found[id(weight)] = Found(
                prefix + "weight",
                [ParamRef(mod, "weight")],
                weight,
                (prefix + "weight_scale_inv", ParamRef(mod, "weight_scale_inv"), scale),
                block,
            )
        for attr, param in mod._parameters.items():
            if param is None or id(param) in ignored or pair is not None or _adapter(param) is None:
                continue
            found.setdefault(id(param), Found(prefix + attr, [], param)).refs.append(ParamRef(mod, attr))
        for cname, child in reversed(list(mod._modules.items())):
            if child is not None:
                stack.append((f"{prefix}{cname}.", child))
    return list(found.values())


def ignored_quantized(modules: Sequence[nn.Module], ignored: set[int]) -> list[str]:
    """The names of quantized weights under ``modules`` that ``ignored_params`` leaves replicated
    (whole on every rank: no memory saved, the silent failure of 4-bit weights under FSDP)."""
    if not ignored:
        return []
    out = []
    for m in modules:
        for name, p in m.named_parameters():
            if id(p) in ignored and _adapter(p) is not None and name not in out:
                out.append(name)
    return out


@dataclass(frozen=True)
class QuantizedStats:
    """Bytes of one group's quantized buffer set on this rank: ``local_bytes`` persistent, ``gathered_bytes``
    moved by one unshard's all-gather (``W * S``), ``total_bytes`` of all its tensors (payload and
    scales), ``constant_bytes`` replicated (code tables, offsets)."""

    local_bytes: int
    gathered_bytes: int
    total_bytes: int
    constant_bytes: int
    numel: int  # quantized values


class FrozenQuantizedBuffers(BufferSet):
    """The byte segment and the all-gather of a group's frozen quantized weights ([Note: frozen
    quantized buffers]); nothing to reduce."""

    def __init__(
        self,
        name: str,
        found: list[Found],
        process_group: dist.ProcessGroup,
        *,
        alignment_bytes: int,
        tile_placement: bool | str = False,
    ) -> None:
        super().__init__(name, process_group)
        constants: SharedConstants = {}  # code tables shared by the group's tensors
        others = {i: f.build(constants) for i, f in enumerate(found) if f.scale is None}
        if tile_placement == "auto":
            tile_placement = _tiles_pad_less(found, others, self.world_size, alignment_bytes)
        self.tensors = [
            others[i] if i in others else f.build(constants, tile_placement=bool(tile_placement))
            for i, f in enumerate(found)
        ]
        devices = {f.param.device for f in found}
        if len(devices) > 1:
            raise ShardingError(f"the quantized weights of {name!r} are on several devices {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.numel = sum(t.numel for t in self.tensors)
        self.layout: QuantizedLayout = plan_quantized(
            [(t.sections, t.n_units) for t in self.tensors], self.world_size, alignment_bytes
        )
        check_same_layout(f"{name} (quantized weights)", self.layout.layout_hash(), process_group)
        self.local = torch.zeros(self.layout.segment_bytes, dtype=torch.uint8, device=self.device)  # [S]
        self._gathered_bytes: torch.Tensor | None = None  # [W * S] while an all-gather is in flight
        with torch.no_grad():
            for piece in self.layout.pieces[self.rank]:
                t = self.tensors[piece.tensor]
                for (lo, hi, off), src in zip(piece.ranges, t.sources, strict=True):
                    self.local[off : off + hi - lo].copy_(src[lo:hi])
        for t in self.tensors:
            t.sources = []  # the originals are released: this rank keeps only its segment
            t.sharded = nn.Parameter(self._payload_piece(t), requires_grad=False)
            t.extra_sharded = [nn.Parameter(self.local[:0], requires_grad=False) for _ in t.extra]
            t.set_module_params(unsharded=False)
            for ref in t.refs:
                prepare_module(ref.module)
        self._free_gathered()

    def _payload_piece(self, t: QuantizedTensor) -> torch.Tensor:
        piece = self.piece_of(t)
        if piece is None:
            return self.local[:0]
        lo, hi, off = piece.ranges[0]
        return self.local[off : off + hi - lo]

    def piece_of(self, t: QuantizedTensor) -> QuantizedPiece | None:
        """This rank's piece of ``t`` (its units are contiguous, so at most one), if any."""
        index = self.tensors.index(t)
        return next((p for p in self.layout.pieces[self.rank] if p.tensor == index), None)

    # -- state dicts ([Note: quantized state dicts] in _quantized_state.py) -----------------------
    @torch.no_grad()
    def write_piece(self, t: QuantizedTensor, sections: list[torch.Tensor]) -> None:
        """Copy this rank's bytes of each of ``t``'s sections (``uint8``, in section order) into the segment."""
        piece = self.piece_of(t)
        if piece is None:
            return
        for (lo, hi, off), src in zip(piece.ranges, sections, strict=True):
            assert src.numel() == hi - lo, (t.fqn, src.numel(), hi - lo)
            dst = self.local[off : off + hi - lo]
            if src.numel() and src.data_ptr() != dst.data_ptr():
                dst.copy_(src)

    @torch.no_grad()
    def full_sections(self) -> list[list[torch.Tensor]]:
        """Every tensor's whole byte sections (collective: one all-gather of the segments)."""
        S, W = self.layout.segment_bytes, self.world_size
        buf = torch.empty(W * S, dtype=torch.uint8, device=self.device)
        self.agree(f"the all-gather of the whole quantized tensors of group {self.described}", S, torch.uint8)
        all_gather_into(buf, self.local, self.process_group)
        out = [[torch.empty(s.nbytes, dtype=torch.uint8, device=self.device) for s in t.sections] for t in self.tensors]
        for r, pieces in enumerate(self.layout.pieces):
            for piece in pieces:
                t = self.tensors[piece.tensor]
                for k, ((lo, hi, off), dst) in enumerate(zip(piece.ranges, out[piece.tensor], strict=True)):
                    t.put_section(k, dst, buf[r * S + off : r * S + off + hi - lo], lo, hi)
        return out

    def stats(self) -> QuantizedStats:
        S, W = self.layout.segment_bytes, self.world_size
        constants = sum(t.constant_bytes for t in self.tensors)
        return QuantizedStats(S, W * S, self.layout.total_bytes, constants, self.numel)

    # -- all-gather -------------------------------------------------------------------------------
    def unshard(self, *, async_op: bool = False) -> None:
        """Issue the all-gather of every rank's segment; :meth:`wait_unshard` finishes it."""
        if self.sharded_state is not ShardedState.SHARDED:
            if not async_op:
                self.wait_unshard()
            return
        S, W = self.layout.segment_bytes, self.world_size
        self.agree(f"the all-gather of the quantized weights of group {self.described}", S, torch.uint8)
        self._gathered_bytes = torch.empty(W * S, dtype=torch.uint8, device=self.device)
        self._pending.append(all_gather_into(self._gathered_bytes, self.local, self.process_group, async_op=True))
        self.sent(0, self._gathered_bytes.numel(), W * self.layout.segment_bytes, torch.uint8, "quantized bytes")
        self.sharded_state = ShardedState.UNSHARDING
        self.count(0)
        if not async_op:
            self.wait_unshard()

    @property
    def gathers_on_copies(self) -> bool:
        return holds_copies(self.process_group, self.device)

    @property
    def gather_wire(self) -> str:
        return "quantized bytes"

    @property
    def gather_what(self) -> str:
        return f"the all-gather of the quantized weights of group {self.name!r}"

    def _finish_unshard(self) -> None:
        """Fill the gathered tensors from the gathered bytes, give the modules the unsharded weights."""
        buf, S = self._gathered_bytes, self.layout.segment_bytes
        assert buf is not None
        self._alloc_gathered()
        with torch.no_grad():
            for r, pieces in enumerate(self.layout.pieces):
                for piece in pieces:
                    t = self.tensors[piece.tensor]
                    for k, ((lo, hi, off), dst) in enumerate(zip(piece.ranges, t.targets, strict=True)):
                        # refilled with the bytes it had: not an in-place change for autograd
                        with torch.autograd._unsafe_preserve_version_counter(dst):
                            t.put_section(k, dst, buf[r * S + off : r * S + off + hi - lo], lo, hi)
        self._gathered_bytes = None
        for t in self.tensors:
            t.set_module_params(unsharded=True)

    def reshard(self) -> None:
        """Give the modules their payload pieces back and free the gathered tensors."""
        if self.sharded_state is ShardedState.UNSHARDING:  # a prefetch nobody used
            self.wait_unshard()
        if self.sharded_state is ShardedState.SHARDED:
            return
        for t in self.tensors:
            t.set_module_params(unsharded=False)
        self._free_gathered()
        self.sharded_state = ShardedState.SHARDED

    def _alloc_gathered(self) -> None:
        for t in self.tensors:
            for g in t.gathered:
                nbytes = g.numel() * g.element_size()
                if g.untyped_storage().size() != nbytes:
                    g.untyped_storage().resize_(nbytes)

    def _free_gathered(self) -> None:
        for t in self.tensors:
            for g in t.gathered:
                g.untyped_storage().resize_(0)


def frozen_buffers(state: ModuleState | BuffersView) -> FrozenQuantizedBuffers | None:
    """The frozen quantized buffer set of a group, if it has one ([Note: frozen quantized buffers]);
    None for another dtype's buffer set read as a group (it holds none)."""
    if not isinstance(state, ModuleState):
        return None
    return next((b for b in state.buffer_sets if isinstance(b, FrozenQuantizedBuffers)), None)


def quantized_stats(model: nn.Module) -> dict[str, QuantizedStats]:
    """This rank's bytes of every group's frozen quantized weights under ``model``, by the sharded
    module's name."""

    out = {}
    for prefix, m in model.named_modules():
        st = state_of(m)
        if st is not None and (fq := frozen_buffers(st)) is not None:
            out[prefix] = fq.stats()
    return out
