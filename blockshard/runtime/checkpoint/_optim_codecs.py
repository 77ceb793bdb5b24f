"""How each kind of optimizer state is placed in global tensors, so that DCP can reshard it.

[Note: optimizer state codecs]
A rank's optimizer state describes its piece ``[start, start + n)`` of a parameter of global
shape ``S``. Each kind of state is written as entries of *global* tensors that hold the state of
the whole parameter, of which the rank's state is one flat run (a :class:`PieceTensor`), so a
checkpoint saved at W loads at any W' as long as the new pieces cut the state where its own blocks
end (what the optimizer's block semantics guarantee):

* **element-wise** (a tensor of the piece's shape: AdamW's moments, Muon's momentum, bitsandbytes'
  ``state1`` / ``state2`` in uint8 or fp32): a piece of ``S`` at ``start``;
* **per block of B elements** (bitsandbytes' ``absmax1`` / ``absmax2``, B = 256; torchao
  ``OptimState8bit.scale``, B = its ``block_size``): a piece of a vector of ``ceil(numel(S) / B)``
  at ``start / B``, which needs ``start`` and (unless the piece ends the tensor) ``n`` to be
  multiples of B: the quantized state is restored exactly, never re-quantized. For a piece of a
  tensor-parallel parameter (bitsandbytes' and torchao's state), the piece's elements are runs of
  the global flattening (one per TP-local row under ``Shard(1)``; [Note: tensor-parallel
  parameters]), each starting on a block: its blocks are the global tensor's, and the entry is
  those runs' blocks, as boxes of the same vector;
* **torchao ``OptimState8bit`` / ``OptimStateFp8`` / ``OptimState4bit``** (tensor subclasses):
  their ``codes`` element-wise (4-bit: two codes per byte, a piece at ``start / 2`` of a vector of
  ``numel(S) / 2``), their ``scale`` per block, ``qmap`` (the fixed code book) as it is;
* **state an optimizer places itself**: an optimizer that implements :class:`HasStateCodecs`
  names a :class:`StateCodec` per state key (blockshard's ``BlockedShampoo`` does for its
  per-tile ``blocks``: blockshard/optim/_shampoo_codec.py); the checkpoint layer hands it a
  :class:`StatePiece` and never imports the optimizer;
* one-element tensors that are no piece (a step count) and Python scalars: as they are (every rank
  holds the same value; DCP keeps one copy), as are bitsandbytes' ``qmap1`` / ``qmap2``.

Anything else raises :class:`~blockshard.runtime.CheckpointError` naming the key. A piece that cuts
a block raises too, at save and at load (loading builds the same entries to fill).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from blockshard._arith import ceil_div
from blockshard._errors import CheckpointError
from blockshard.runtime.checkpoint._piece_tensor import PieceTensor, entry_group, param_entry
from blockshard.runtime.core._param import ShardedParam, managed_tag

__all__ = ["HasStateCodecs", "StateCodec", "StatePiece", "decode_state", "encode_state", "state_error"]

_SCALARS = (int, float, bool, str, type(None))
_BNB_BLOCK = 256  # bitsandbytes' blockwise 8-bit optimizer state (Optimizer2State.init_state)
_BNB_PER_BLOCK = ("absmax1", "absmax2")
_BNB_CODE_BOOKS = ("qmap1", "qmap2")


def state_error(name: str, key: str, why: str, fix: str) -> CheckpointError:
    """The error for optimizer state ``key`` of parameter ``name`` that cannot be placed."""
    return CheckpointError(f"optimizer state {key!r} of parameter {name!r} {why}. Fix: {fix}")


_error = state_error
SAME_W_FIX = "checkpoint this optimizer with optimizer.state_dict() and reload it at the same world size and semantics"
_SAME_W_FIX = SAME_W_FIX


@dataclass(frozen=True, slots=True, kw_only=True)
class StatePiece:
    """What a :class:`StateCodec` sees of one rank's piece of a parameter."""

    name: str  # the parameter's name (checkpoint entries are named after it)
    start: int  # the piece's first element in the row-major flattening of the whole tensor
    numel: int  # elements in the piece
    shape: tuple[int, ...]  # the whole tensor's shape
    local_shape: tuple[int, ...]  # the piece's block shape, as the optimizer sees it
    process_group: Any  # the process group the tensor's pieces are spread over (every rank under TP)
    # a tensor-parallel parameter whose tp cut splits it ([Note: tensor-parallel parameters]): the
    # global tensor's shape and where this rank's TP-local tensor (``shape``) starts in it; None else
    tp_shape: tuple[int, ...] | None = None
    tp_offsets: tuple[int, ...] | None = None


class StateCodec(Protocol):
    """Places one key of an optimizer's per-parameter state in global tensors ([Note: optimizer
    state codecs]): ``encode`` returns the checkpoint entry (``PieceTensor`` pieces of global
    tensors, or a dict of them), ``decode`` the live value from an entry ``dcp.load`` filled. A codec
    with ``places_tp_pieces = True`` places pieces of TP-split parameters too (from the piece's
    ``tp_shape`` / ``tp_offsets``); for any other such a piece is refused before it is asked."""

    def encode(self, value: Any, piece: StatePiece, param_group: Mapping[str, Any]) -> object: ...

    def decode(self, saved: Any, live: Any, piece: StatePiece, param_group: Mapping[str, Any]) -> object: ...


@runtime_checkable
class HasStateCodecs(Protocol):
    """An optimizer that places some of its state itself: state key -> codec."""

    def blockshard_state_codecs(self) -> Mapping[str, StateCodec]: ...


def _piece(name: str, sp: ShardedParam) -> StatePiece:
    tp = sp.tp if _tp_cut(sp) else None
    return StatePiece(
        name=name,
        start=sp.local_start,
        numel=sp.local_numel,
        shape=tuple(sp.shape),
        local_shape=tuple(sp.sharded.shape),
        process_group=entry_group(sp, _pg(sp)) if tp is not None else _pg(sp),
        tp_shape=tuple(tp.shape) if tp is not None else None,
        tp_offsets=tuple(tp.offsets) if tp is not None else None,
    )


def _codec_step(name: str, key: str, sp: ShardedParam, codec: StateCodec) -> StatePiece:
    """The piece a codec places, after refusing a TP-split piece the codec cannot place."""
    if not getattr(codec, "places_tp_pieces", False):
        _refuse_tp_split(name, key, sp)
    return _piece(name, sp)


def _codec(optimizer: torch.optim.Optimizer, key: str) -> StateCodec | None:
    return optimizer.blockshard_state_codecs().get(key) if isinstance(optimizer, HasStateCodecs) else None


def _is_bnb(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__module__.startswith("bitsandbytes.")


_AO_STATES = ("OptimState8bit", "OptimStateFp8", "OptimState4bit")  # torchao.optim's quantized state


def _is_ao(value: object) -> bool:
    return type(value).__name__ in _AO_STATES and type(value).__module__.startswith("torchao.")


def _ao_blocks(value: Any, part: str) -> int:
    """Elements of the parameter per entry of a torchao state's ``part``: 1 for element-wise codes."""
    if part == "scale":
        return int(value.block_size)
    return 2 if type(value).__name__ == "OptimState4bit" else 1  # 4-bit: two codes per byte


def _encode_ao(name: str, key: str, value: Any, sp: ShardedParam) -> dict[str, object]:
    """A torchao quantized state: ``codes`` element-wise (4-bit: one byte per 2 elements), ``scale``
    per block, ``qmap`` (8-bit, 4-bit) as it is. Of a TP-split parameter: by the global tensor's
    elements and blocks, as bitsandbytes' state."""
    out: dict[str, object] = {}
    for part in ("codes", "scale"):
        tensor, block, label = getattr(value, part), _ao_blocks(value, part), f"{key}.{part}"
        if block == 1:
            out[part] = (
                param_entry(sp, tensor, f"{name}.{label}", _pg(sp))
                if _tp_cut(sp)
                else PieceTensor(tensor, sp.local_start, sp.shape, name=f"{name}.{label}", process_group=_pg(sp))
            )
        else:
            out[part] = (_tp_per_block if _tp_cut(sp) else _per_block)(name, label, tensor, sp, block)
    return out | ({"qmap": value.qmap} if "qmap" in type(value).tensor_attrs else {})


def _tp_local(name: str, key: str, value: PieceTensor, sp: ShardedParam, block: int) -> torch.Tensor:
    """This rank's values of an entry of a TP-split parameter's state filled by ``dcp.load``:
    element-wise (``block`` 1) in the piece's shape, else one per ``block`` elements."""
    want = sp.entry_boxes() if block == 1 else _tp_block_boxes(sp, block)
    if [(x.offsets, x.sizes) for x in value.boxes] != [tuple(x) for x in want or ()]:
        raise _error(
            name,
            key,
            "in the state dict holds other elements or blocks of the parameter than this rank's TP piece (another "
            "world size or TP plan)",
            "load it through dcp.load into blockshard.optimizer_state_dict(model, optimizer)",
        )
    return sp.from_boxed(value.to_local()) if block == 1 else value.to_local()


def _refuse_tp_split(name: str, key: str, sp: ShardedParam) -> None:
    """Per-block state that blockshard cannot place for a piece of a TP-split parameter (torchao's
    quantized state, a codec that does not place TP pieces) would be in TP-local coordinates: every
    tp rank would write its own under the same global entry. Element-wise state is placed by the TP
    piece's boxes, bitsandbytes' per-block state by its blocks' (``_tp_per_block``), BlockedShampoo's
    tiles by its codec."""
    tp = sp.tp
    if tp is not None and tp.cut:
        raise _error(
            name,
            key,
            f"is per-block state of a tensor-parallel parameter (placed {tp.label}, global shape {tp.shape}), "
            "which blockshard places in global tensors only for element-wise state, bitsandbytes' and torchao's "
            "blocks and BlockedShampoo's tiles where the tp cut keeps them whole (each tp rank's blocks would land "
            "on the same entries)",
            "save and load this optimizer with optimizer.state_dict() at the same (dp, tp) layout, or step the "
            "TP-split weights with an element-wise optimizer or blockshard.optim.Muon",
        )


def _tp_cut(sp: ShardedParam) -> bool:
    return sp.tp is not None and sp.tp.cut


def _global_runs(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """The runs ``[start, end)`` of the row-major flattening of ``shape`` that the box covers, in its order."""
    if not shape:
        return [(0, 1)]
    k = len(shape) - 1
    while k > 0 and sizes[k] == shape[k]:  # dims after k are whole: one run per index of the dims before k
        k -= 1
    strides = [math.prod(shape[j + 1 :]) for j in range(len(shape))]
    base = sum(o * st for o, st in zip(offsets, strides, strict=True))
    length = sizes[k] * strides[k]
    runs = []
    for idx in itertools.product(*(range(n) for n in sizes[:k])):
        start = base + sum(i * st for i, st in zip(idx, strides, strict=False))
        runs.append((start, start + length))
    return runs


def _tp_block_boxes(sp: ShardedParam, block: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """This rank's piece of a TP-split parameter as runs of the global tensor's ``block``-element
    blocks (boxes of the vector of ``ceil(numel / block)``), in the piece's order; None when a run
    does not start on a block or ends inside one before the tensor's end (its blocks are not the
    global tensor's)."""
    tp = sp.tp
    if tp is None:
        return None
    numel = math.prod(tp.shape)
    out: list[tuple[int, int]] = []
    for offsets, sizes in tp.boxes(tuple(sp.shape), sp.local_start, sp.local_numel):
        for a, b in _global_runs(tuple(tp.shape), offsets, sizes):
            if a % block or (b % block and b != numel):
                return None
            lo, hi = a // block, ceil_div(b, block)
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi)
            else:
                out.append((lo, hi))
    return [((lo,), (hi - lo,)) for lo, hi in out]


def _tp_per_block(name: str, key: str, value: torch.Tensor, sp: ShardedParam, block: int) -> PieceTensor:
    """``value`` (one entry per ``block`` elements of a TP-split parameter's piece) as boxes of the
    global tensor's per-block vector (see the per-block case of [Note: optimizer state codecs])."""
    boxes = _tp_block_boxes(sp, block)
    if sp.tp is None or boxes is None or sum(s[0] for _, s in boxes) != value.numel():
        _refuse_tp_split(name, key, sp)
        raise AssertionError(name)  # unreachable: a TP-split piece (_tp_cut) is refused above
    return PieceTensor(
        value,
        0,
        (ceil_div(math.prod(sp.tp.shape), block),),
        name=f"{name}.{key}",
        process_group=entry_group(sp, _pg(sp)),
        boxes=boxes,
    )


def _pg(sp: ShardedParam) -> Any:
    """The process group the parameter's pieces are spread over."""
    tag = managed_tag(sp.sharded)
    return tag.process_group if tag is not None else None


def _per_block(name: str, key: str, value: torch.Tensor, sp: ShardedParam, block: int) -> PieceTensor:
    """``value`` (one entry per ``block`` elements of the piece) as a piece of the whole tensor's."""
    start, n, numel = sp.local_start, sp.local_numel, sp.numel
    if value.numel() != ceil_div(n, block) or start % block or (n % block and start + n != numel):
        raise _error(
            name,
            key,
            f"has {value.numel()} entries, one per {block}-element block, but this rank's piece [{start}, "
            f"{start + n}) of {numel} elements cuts such a block",
            f"shard this parameter with the optimizer's block semantics (e.g. semantics='bnb8bit' or 'ao8bit'), "
            f"or {_SAME_W_FIX}",
        )
    return PieceTensor(value, start // block, (ceil_div(numel, block),), name=f"{name}.{key}", process_group=_pg(sp))


def encode_state(name: str, key: str, value: Any, p: torch.Tensor, sp: ShardedParam | None, ctx: Any) -> object:
    """The checkpoint entry for ``optimizer.state[p][key]`` (see [Note: optimizer state codecs]);
    ``ctx`` is ``(optimizer, param_group)``."""
    optimizer, group = ctx
    if isinstance(value, _SCALARS):
        return value
    if sp is not None and (codec := _codec(optimizer, key)) is not None:
        return codec.encode(value, _codec_step(name, key, sp, codec), group)
    if sp is not None and _is_ao(value):
        return _encode_ao(name, key, value, sp)
    if not isinstance(value, torch.Tensor) or type(value) is not torch.Tensor:
        raise _error(
            name,
            key,
            f"is a {type(value).__name__}, which blockshard cannot place in the global tensor (quantized or "
            "per-block state of an optimizer it does not know)",
            _SAME_W_FIX,
        )
    if sp is None or (value.dim() == 0 and p.dim() != 0):
        return value  # the same on every rank (a parameter outside any group, a step count)
    if _is_bnb(optimizer) and key in _BNB_CODE_BOOKS:  # before the shape test: a 256-element piece has its shape
        return value  # the fixed code book, the same on every rank
    if tuple(value.shape) == tuple(p.shape):  # element-wise state; a master in packed tile order: as its boxes
        return param_entry(sp, value, f"{name}.{key}", _pg(sp))
    if _is_bnb(optimizer) and key in _BNB_PER_BLOCK:
        if _tp_cut(sp):
            return _tp_per_block(name, key, value, sp, _BNB_BLOCK)
        return _per_block(name, key, value, sp, _BNB_BLOCK)
    raise _error(
        name,
        key,
        f"has shape {tuple(value.shape)}, neither the piece's {tuple(p.shape)} nor a scalar (e.g. per-block "
        "state of an optimizer blockshard does not know): blockshard cannot place it in the global tensor",
        _SAME_W_FIX,
    )


# -- loading --------------------------------------------------------------------------------------
def _copy_into(have: torch.Tensor, value: torch.Tensor) -> None:
    if value.data_ptr() != have.data_ptr():
        have.copy_(value.view(have.shape))


def decode_state(name: str, key: str, value: object, have: object, sp: ShardedParam | None, ctx: Any) -> object:
    """The live value of ``optimizer.state[p][key]`` after loading ``value`` (an entry of
    :func:`encode_state`'s form, filled by ``dcp.load``) into ``have`` (the live value)."""
    optimizer, group = ctx
    if sp is not None and (codec := _codec(optimizer, key)) is not None:
        return codec.decode(value, have, _codec_step(name, key, sp, codec), group)
    if isinstance(value, dict) and _is_ao(have):
        for part in type(have).tensor_attrs:  # type: ignore[attr-defined]
            saved, live = value[part], getattr(have, part)
            if sp is not None and _tp_cut(sp) and isinstance(saved, PieceTensor):
                saved = _tp_local(name, f"{key}.{part}", saved, sp, _ao_blocks(have, part))
            _copy_into(live, _local(name, f"{key}.{part}", saved, live))
        return have
    if (
        isinstance(value, PieceTensor)
        and sp is not None
        and _is_bnb(optimizer)
        and key in _BNB_PER_BLOCK
        and _tp_cut(sp)
    ):
        if [(x.offsets, x.sizes) for x in value.boxes] != _tp_block_boxes(sp, _BNB_BLOCK):
            raise _error(
                name,
                key,
                "in the state dict holds other blocks of the parameter than this rank's TP piece (another world "
                "size or TP plan)",
                "load it through dcp.load into blockshard.optimizer_state_dict(model, optimizer)",
            )
        value = value.to_local()
    # [Note: packed tile order]; a TP piece's boxes ([Note: tensor-parallel parameters])
    elif isinstance(value, PieceTensor) and sp is not None and (sp.order is not None or sp.tp is not None):
        if [(x.offsets, x.sizes) for x in value.boxes] != [tuple(x) for x in sp.entry_boxes() or ()]:
            raise _error(
                name,
                key,
                "in the state dict holds other boxes of the parameter than this rank's tiles or TP piece (another "
                "world size, tile_placement or TP plan)",
                "load it through dcp.load into blockshard.optimizer_state_dict(model, optimizer)",
            )
        value = sp.from_boxed(value.to_local())
    if isinstance(value, PieceTensor):
        value = _local(name, key, value, have)
    if isinstance(have, torch.Tensor) and isinstance(value, torch.Tensor):
        if value.numel() != have.numel():
            raise _error(
                name,
                key,
                f"was saved with shape {tuple(value.shape)}, this rank's is {tuple(have.shape)}",
                "load it through dcp.load into blockshard.optimizer_state_dict(model, optimizer)",
            )
        _copy_into(have, value)
        return have
    return value


def _local(name: str, key: str, value: torch.Tensor, have: object) -> torch.Tensor:
    if not isinstance(value, PieceTensor):
        return value
    if not isinstance(have, torch.Tensor) or value.to_local().numel() != have.numel():
        raise _error(
            name,
            key,
            f"in the state dict is piece [{value.local_start}, {value.local_start + value.to_local().numel()}) of "
            "it, not this rank's (another world size or semantics)",
            "load it through dcp.load into blockshard.optimizer_state_dict(model, optimizer)",
        )
    return value.to_local()
