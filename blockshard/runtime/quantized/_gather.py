"""Trainable weights gathered quantized (MX, blockwise FP8): a buffer set that all-gathers tile bytes.

[Note: quantized gather]
``fully_shard(module, semantics={"*_proj.weight": "fp8_block:128"}, quantized_gather=True)`` (or
``"mx"`` / ``"mx:4"``): the floating-point parameters whose semantics is a tile quantizer get a
buffer set of their own in the group (the last of ``state.buffer_sets``, [Note: buffer sets],
planned as its own layout by those semantics, so every rank's piece of each is whole tiles: 1 x 32 blocks along the
last dim, ``B``-row stripes of ``B x B`` tiles). Its parameters train as any other:
  * ``local`` [S] holds the master pieces (fp32 or bf16): what the optimizer steps; gradients are
    reduce-scattered into them as in the primary buffer set (its own reduce-scatter, issued right
    after the primary one's and waited for with it: ``ModuleState.training_sets``, while any of
    them is trainable; so such a group has two reduce-scatter inputs alive where others have one);
  * ``payload`` uint8 [Sq]: this rank's pieces quantized, each as its payload (1 byte per value,
    MXFP4 half) then its scales (1 E8M0 byte per 32 values; 4 bytes per FP8 tile), 16-byte aligned;
    ``Sq`` is the largest rank's, so the all-gather is of equal segments;
  * the unshard all-gathers ``payload`` (uint8 [W * Sq], alive until the wait) **instead of** the
    floats, and the wait fills ``gathered`` (the param dtype, the unsharded parameters' storage)
    with every rank's pieces dequantized: the forward computes on the quantize-dequantize of the
    whole weight (fake quantization) and autograd's gradient of that reaches the master unchanged
    (straight-through).
Each rank quantizes only its own whole tiles, so the gathered bytes equal quantizing the whole
(gathered) master weight, bitwise (tests/quantized/test_fast_quantized_gather.py; the control
quantizes the pieces of an element-wise cut, whose tiles straddle ranks). Quantization runs
outside the gather hooks when the user calls :func:`precompute_quantized_gather` after
``optimizer.step()`` (as torchao's ``precompute_float8_dynamic_scale_for_fsdp``); else at the
next unshard, whenever ``local``'s version counter moved since its last quantization (every
in-place update of a piece bumps it), so a forgotten call costs time, never a stale weight. Edits
the counter does not see (through ``p.data``, under ``torch.inference_mode``) need the call.
The pre-backward unshard finds the payload current and gathers the same bytes again.

[Note: packed tile order in the engine]
With ``tile_placement=True`` as well, every ``fp8_block:B`` master (2-D, or stacked ``(E, rows,
cols)`` experts) is laid out in packed tile order ([Note: packed tile order] in
``semantics/_tiles.py``; ``_api._build_group`` calls the planner's ``packed_masters``, so the layout
is the plan's): its layout tensor is ``n_slots * B * B`` values, the tile-major order's tiles
packed into slots of ``B * B`` (a full tile a slot, an edge's tiles as many to a slot as fit, zeros
in the rest). The unit is one slot, so a rank's piece is a run of whole slots, its tiles a run of
the tile-major order. ``ShardedParam.order`` (a ``_tile_major.PackedTileOrder``) says so to every
reader: the init copy takes the tiles out of the row-major weight (``take_into``), the gradient
copy into the reduce-scatter input does the same (writing the slots' zeros, so their gradient is
zero and an element-wise step keeps them at zero: AdamW's ``m = v = 0`` and weight decay of 0),
the quantizer (``PackedFP8Quantizer``) takes each tile's amax over its own values and sends their
payload only (the payload is the whole weight's, bitwise), and the dequantization writes each tile's real values at their row-major place
in the gathered weight (the unsharded parameter is row-major, as with stripes). The sharded
parameter is 1-D in that order: state dicts name its piece as boxes of whole tiles (``piece_boxes``,
``to_boxed`` / ``from_boxed``), element-wise optimizer state goes the same way, the safetensors
export collects a master whole on rank 0 and writes it row-major, and only element-wise optimizers
may step it (``_optim_guard._check_stored_order`` refuses the others by name).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from blockshard._errors import QuantizedWeightError, ShardingError
from blockshard.planner import GroupLayout
from blockshard.runtime.core._buffers import ParamBuffers
from blockshard.runtime.core._collectives import all_gather_into
from blockshard.runtime.core._common import ShardedState
from blockshard.runtime.core._inspect import BuffersView, states_under
from blockshard.runtime.core._param import ParamRef, ShardedParam
from blockshard.runtime.quantized._frozen import QuantizedStats
from blockshard.runtime.quantized._tile_major import PackedTileOrder
from blockshard.runtime.quantized._tile_quant import (
    FP8BlockQuantizer,
    PackedFP8Quantizer,
    TileQuantizer,
    tile_quantizer,
)
from blockshard.semantics import SemanticsRules, TensorSpec
from blockshard.semantics._quantizers import MX, FP8Block

__all__ = ["QuantizedGatherBuffers", "precompute_quantized_gather", "quantized_gather_stats", "split_quantized_gather"]

_ALIGN = 16  # bytes: every section starts here (an fp32 view of the scales needs 4)

_Part = tuple[list[str], list[nn.Parameter], list[list[ParamRef]]]


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def split_quantized_gather(
    names: list[str], params: list[nn.Parameter], refs: list[list[ParamRef]], rules: object
) -> tuple[_Part, _Part, dict[str, TileQuantizer]]:
    """(gathered quantized, the rest, the quantizers by name): the parameters whose semantics is
    ``mx``, ``mx:4`` or ``fp8_block:B`` are gathered quantized (floating-point, in one dtype)."""
    r = SemanticsRules.coerce(rules)
    chosen: dict[str, TileQuantizer] = {}
    for n, p, ref in zip(names, params, refs, strict=True):
        spec = TensorSpec(name=n, shape=tuple(p.shape), dtype=p.dtype, module_type=type(ref[0].module).__name__)
        sems = r.matching(spec)
        if any(isinstance(s, (MX, FP8Block)) for s in sems):  # raises unless a float master of whole tiles
            chosen[n] = tile_quantizer(n, tuple(p.shape), p.dtype, sems)
    keep = [i for i, n in enumerate(names) if n in chosen]
    rest = [i for i, n in enumerate(names) if n not in chosen]
    dtypes = {params[i].dtype: names[i] for i in keep}
    if len(dtypes) > 1:
        shown = ", ".join(f"{n!r} ({str(d).removeprefix('torch.')})" for d, n in dtypes.items())
        raise QuantizedWeightError(
            f"quantized gather: the weights gathered quantized in one group have several dtypes ({shown}); their "
            "master pieces share one buffer. Fix: cast them to one dtype before fully_shard, or shard them in "
            "separate fully_shard calls"
        )

    def part(ix: list[int]) -> _Part:
        return [names[i] for i in ix], [params[i] for i in ix], [refs[i] for i in ix]

    return part(keep), part(rest), chosen


@dataclass(frozen=True)
class PayloadPiece:
    """One rank's piece of a tensor in the quantized segment: elements ``[start, start + numel)``,
    its payload at ``offset``, its scales at ``scale_offset`` (bytes into the rank's segment)."""

    param: int  # position in the group's params
    start: int
    numel: int
    offset: int
    payload_bytes: int
    scale_offset: int
    scale_bytes: int


def plan_payload(
    name: str, layout: GroupLayout, params: list[ShardedParam], quantizer: Callable[[ShardedParam], TileQuantizer]
) -> tuple[list[list[PayloadPiece]], int]:
    """Every rank's quantized pieces and the segment size ``Sq`` (bytes); raises unless every
    piece of the float layout is whole tiles."""
    by_index = {sp.index: k for k, sp in enumerate(params)}
    plans, sizes = [], []
    for r in range(layout.world_size):
        pos, out = 0, []
        for piece in layout.pieces(r):
            k = by_index[piece.index]
            sp = params[k]
            q = quantizer(sp)
            end = piece.start + piece.numel
            unit = q.unit_numel
            if piece.start % unit or (end % unit and end != sp.stored_numel):
                raise QuantizedWeightError(
                    f"quantized gather of {sp.fqn!r} (shape {sp.shape}, {q.label}) in group {name!r}: rank {r} holds "
                    f"elements [{piece.start}, {end}), which cut a tile of {unit} values, so its quantization "
                    "would differ from the whole weight's. Fix: give it only its quantizer semantics (an "
                    "optimizer's owner cut may not follow tiles), or policy='whole'"
                )
            pb, sb = q.payload_bytes(piece.start, piece.numel), q.scale_bytes(piece.start, piece.numel)
            out.append(PayloadPiece(k, piece.start, piece.numel, pos, pb, pos + _aligned(pb), sb))
            pos += _aligned(pb) + _aligned(sb)
        plans.append(out)
        sizes.append(pos)
    return plans, max(_ALIGN, *sizes)


def _in_order(q: TileQuantizer, order: object) -> TileQuantizer:
    """``q``, or its packed-tile-order form for a master stored in that order."""
    if order is None:
        return q
    assert isinstance(order, PackedTileOrder) and isinstance(q, FP8BlockQuantizer), (q, order)
    return PackedFP8Quantizer(q.fqn, q.shape, tile=q.tile, order=order)


class QuantizedGatherBuffers(ParamBuffers):
    """A buffer set whose unshard all-gathers its pieces quantized ([Note: quantized gather]); its
    parameters train, so it reduces their gradients while any of them requires grad."""

    def __init__(
        self, name: str, params: list[ShardedParam], *args: Any, quantizers: dict[str, TileQuantizer], **kwargs: Any
    ) -> None:
        # by parameter, not name: a list group's names change when its root binds them (_list_groups.py);
        # a master in packed tile order is quantized by its tiles ([Note: packed tile order in the engine])
        self.quantizers = {id(sp): _in_order(quantizers[sp.fqn], sp.order) for sp in params}
        self.plan: list[list[PayloadPiece]] = []
        self.segment_bytes = 0
        self._quantized_version: int | None = None  # local's version at the last quantization
        self._gathered_bytes: torch.Tensor | None = None  # [W * Sq] while the all-gather is in flight
        self.quantizations = 0  # how often this rank quantized its pieces (tests, stats)
        super().__init__(name, params, *args, **kwargs)

    @property
    def trains(self) -> bool:
        return super().trains and any(sp.sharded.requires_grad for sp in self.params)

    def quantizer(self, sp: ShardedParam) -> TileQuantizer:
        return self.quantizers[id(sp)]

    def check_convertible(self, dtype: torch.dtype) -> None:
        """Weights all-gathered quantized keep their masters' dtype ([Note: converting a sharded
        model] in core/_module.py): their payload and the quantizer are planned for it."""
        raise ShardingError(
            f"converting group {self.name!r} (model.to(...), .half(), .double()) to {dtype}: its weights are "
            f"all-gathered quantized from {self.orig_dtype} masters, planned for that dtype. Fix: convert the model "
            "before fully_shard, or compute in another dtype with mp_policy=MixedPrecisionPolicy(param_dtype=...)"
        )

    # -- buffers ----------------------------------------------------------------------------------
    def _place(self, layout: GroupLayout) -> None:
        super()._place(layout)
        self.plan, self.segment_bytes = plan_payload(self.name, layout, self.params, self.quantizer)
        self._alloc_payload()

    def _alloc_buffers(self, device: torch.device, S: int, *, zeros: bool) -> None:
        super()._alloc_buffers(device, S, zeros=zeros)
        self.send = self.local  # never sent as floats: no cast buffer under mixed precision
        if self.segment_bytes:  # materialize: on the new device
            self._alloc_payload()

    def _alloc_payload(self) -> None:
        self.payload = torch.zeros(self.segment_bytes, dtype=torch.uint8, device=self.device)  # [Sq]
        self._quantized_version = None

    @property
    def stale(self) -> bool:
        """Whether a piece may have changed since this rank last quantized them."""
        return self._quantized_version != self.local._version

    @torch.no_grad()
    def quantize_pieces(self, *, force: bool = False) -> bool:
        """Quantize this rank's pieces into ``payload`` (if stale, or ``force``); True if it did."""
        if not (force or self.stale) or self.local.device.type == "meta":
            return False
        for p in self.plan[self.rank]:
            sp = self.params[p.param]
            lo = sp.local_offset + p.start - sp.local_start
            payload, scales = self.quantizer(sp).quantize(self.local[lo : lo + p.numel], p.start)
            self.payload[p.offset : p.offset + p.payload_bytes].copy_(payload)
            self.payload[p.scale_offset : p.scale_offset + p.scale_bytes].copy_(scales)
        self._quantized_version = self.local._version
        self.quantizations += 1
        return True

    # -- all-gather -------------------------------------------------------------------------------
    def unshard(self, *, async_op: bool = False) -> None:
        """As :meth:`ParamBuffers.unshard`, but one all-gather of the quantized segments."""
        if self.sharded_state is not ShardedState.SHARDED or self.layout is None:
            super().unshard(async_op=async_op)
            return
        self.quantize_pieces()
        self.agree(f"the quantized all-gather of group {self.described}", self.payload.numel(), self.payload.dtype)
        self._start_gather()
        W, Sq = self.world_size, self.segment_bytes
        # allocated on the current stream, freed after it waited ([Note: streams])
        self._gathered_bytes = torch.empty(W * Sq, dtype=torch.uint8, device=self.device)
        with self.streams.on("all_gather"):
            self._pending.append(all_gather_into(self._gathered_bytes, self.payload, self.process_group, async_op=True))
        self.sent(0, self._gathered_bytes.numel(), W * Sq, torch.uint8, "quantized payload")  # [Note: traffic]
        self._issued(async_op)

    @property
    def gather_wire(self) -> str:
        return "quantized payload"  # a float all-gather of these masters is a mismatch ([Note: traffic])

    @property
    def gather_what(self) -> str:
        quantized = "" if self._gathered_bytes is None else "quantized "  # else the float all-gather of ParamBuffers
        return f"the {quantized}all-gather of group {self.described}"

    def _finish_unshard(self) -> None:
        if self._gathered_bytes is not None:
            self.streams.current_waits("all_gather")
            self._dequantize_into_gathered(self._gathered_bytes)
            self._gathered_bytes = None
        super()._finish_unshard()

    @torch.no_grad()
    def _dequantize_into_gathered(self, buf: torch.Tensor) -> None:
        """Every rank's pieces, dequantized in the param dtype, at their places in ``gathered``."""
        Sq = self.segment_bytes
        for lo, hi in self.holes:
            self.gathered[lo:hi].zero_()
        for r, pieces in enumerate(self.plan):
            for p in pieces:
                sp = self.params[p.param]
                payload = buf[r * Sq + p.offset : r * Sq + p.offset + p.payload_bytes]
                scales = buf[r * Sq + p.scale_offset : r * Sq + p.scale_offset + p.scale_bytes]
                weight = self.gathered[sp.gathered_offset : sp.gathered_offset + sp.numel]  # row-major
                self.quantizer(sp).dequantize_into(weight, payload, scales, p.start, p.numel)

    @torch.no_grad()
    def whole_payloads(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Every tensor's whole payload and scales, in their dtypes and shapes (collective: one
        all-gather of the quantized segments, quantizing stale pieces first)."""
        self.quantize_pieces()
        W, Sq = self.world_size, self.segment_bytes
        buf = torch.empty(W * Sq, dtype=torch.uint8, device=self.device)
        self.agree(f"the all-gather of the quantized payloads of group {self.described}", Sq, torch.uint8)
        all_gather_into(buf, self.payload, self.process_group)
        parts: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for r, pieces in enumerate(self.plan):
            for p in pieces:
                payload = buf[r * Sq + p.offset : r * Sq + p.offset + p.payload_bytes]
                scales = buf[r * Sq + p.scale_offset : r * Sq + p.scale_offset + p.scale_bytes]
                parts.setdefault(p.param, []).append((p.start, payload, scales))
        out = {}
        for k, got in sorted(parts.items()):
            sp = self.params[k]
            out[sp.fqn] = self.quantizer(sp).assemble(got)
        return out

    def stats(self) -> QuantizedStats:
        total = sum(p.payload_bytes + p.scale_bytes for pieces in self.plan for p in pieces)
        numel = sum(sp.numel for sp in self.params)
        return QuantizedStats(self.segment_bytes, self.world_size * self.segment_bytes, total, 0, numel)


def _gather_sets(model: nn.Module) -> list[tuple[str, QuantizedGatherBuffers]]:
    """Every quantized-gather buffer set under ``model``, with the path its names are relative to."""

    return [
        (prefix, st.buffers)
        for prefix, st in states_under(model)
        if isinstance(st, BuffersView) and isinstance(st.buffers, QuantizedGatherBuffers)
    ]


def precompute_quantized_gather(model: nn.Module) -> int:
    """Quantize every rank-local piece of the weights gathered quantized under ``model`` now (call
    it after ``optimizer.step()``, outside the gather hooks); returns the number of groups. Local
    work only (no collective). Without the call the next unshard quantizes what changed
    ([Note: quantized gather])."""
    groups = _gather_sets(model)
    for _, g in groups:
        g.quantize_pieces(force=True)
    return len(groups)


def quantized_gather_stats(model: nn.Module) -> dict[str, QuantizedStats]:
    """This rank's bytes of every quantized-gather buffer set under ``model``, by the sharded
    module's name: ``local_bytes`` the quantized segment, ``gathered_bytes`` one unshard's
    all-gather, ``total_bytes`` payload and scales of all its weights."""
    return {prefix: g.stats() for prefix, g in _gather_sets(model)}


def full_quantized(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every weight gathered quantized under ``model``: its whole payload and scales by name
    (collective: one all-gather per buffer set; MX: ``qdata``, E8M0 ``scale`` as torchao's
    ``MXTensor``; FP8: float8 ``weight``, fp32 ``weight_scale_inv`` per tile)."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for prefix, g in _gather_sets(model):
        out |= {f"{prefix}.{n}" if prefix else n: v for n, v in g.whole_payloads().items()}
    return out
