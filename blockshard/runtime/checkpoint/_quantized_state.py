"""State dicts of frozen quantized weights: DCP-ready pieces of every section, full entries, loading back.

[Note: quantized state dicts]
A quantized tensor's state-dict entries are its format's own, named as the unsharded model's
``state_dict()`` names them (:class:`~blockshard.runtime.quantized._tensor.StateEntry`, relative
to the module that holds the weight): for bitsandbytes ``Linear4bit`` what its
``_save_to_state_dict`` writes (``weight``, ``weight.absmax``, ``weight.quant_map``, with nested
statistics ``weight.nested_absmax`` and ``weight.nested_quant_map``, and the packed
``weight.quant_state.bitsandbytes__nf4``); for blockwise FP8 ``weight`` and ``weight_scale_inv``.
torchao's ``NF4Tensor`` and ``MXTensor`` are one tensor subclass under ``weight`` in the unsharded
model; sharded, their inner tensors become entries of their own (``weight`` the payload,
``weight.quantized_scalers``, ``weight.scale``, ...), and the full state dict has the subclass again.
* ``model.state_dict()``: every entry that holds a byte section (payload, absmax, scales) is a
  :class:`~blockshard.runtime.PieceTensor` of that section's global shape and dtype holding this
  rank's whole units of it (a view of the group's segment where the bytes are aligned to the
  dtype, else a copy), so DCP saves and reshards it like a float parameter; replicated constants
  (code tables, the packed non-tensor quant state, torchao's ``scaler_mean`` and ``nf4``) are
  plain tensors, the same on every rank. The entries are the same whether or not the group is
  gathered (a forward with ``reshard_after_forward=False`` changes none).
* :func:`full_quantized_entries` (in ``blockshard.full_state_dict``, collective): one all-gather of each
  frozen quantized buffer set's segment, the sections rebuilt, the unsharded model's entries made from them:
  bitwise what the unsharded quantized model's ``state_dict()`` holds.
* ``model.load_state_dict``: PieceTensors of the same pieces (what ``dcp.load`` filled) or full
  entries (an unsharded model's, ``full_state_dict``'s); their bytes go into the segment, each
  constant must equal the model's (a quant state of another quantization raises), a missing
  entry is reported as missing.
* ``blockshard.sharded_state_dict``: the entries of ``model.state_dict()`` as ``LocalShard`` s
  (this rank's piece of each section, constants whole); ``load_sharded_state_dict`` takes them back
  at the same layout, ``load_full_state_dict`` the unsharded model's entries at any world size; a
  missing entry or a piece that is not this rank's raises, naming the entry.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from blockshard._errors import QuantizedWeightError
from blockshard.runtime.checkpoint._piece_tensor import PieceTensor
from blockshard.runtime.quantized._frozen import frozen_buffers
from blockshard.runtime.quantized._tensor import QuantizedTensor, StateEntry, byte_view

__all__ = [
    "StateEntry",
    "default_full",
    "full_entries_of",
    "full_quantized_entries",
    "load_quantized",
    "load_quantized_pieces",
    "quantized_entries",
    "quantized_pieces",
]


def _module_names(root: nn.Module) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, m in root.named_modules(remove_duplicate=False):
        out.setdefault(id(m), []).append(name)
    return out


def _prefixes(t: QuantizedTensor, names: dict[int, list[str]], prefix: str) -> list[str]:
    """The state-dict prefix of every module that holds ``t`` under the root of ``names``."""
    out: list[str] = []
    for ref in t.refs:
        for n in names.get(id(ref.module), []):
            p = f"{prefix}{n}." if n else prefix
            if p not in out:
                out.append(p)
    return out


def _error(t: QuantizedTensor, key: str, what: str, fix: str) -> QuantizedWeightError:
    return QuantizedWeightError(
        f"state-dict entry {key!r} of quantized weight {t.fqn!r} ({t.format}): {what}. Fix: {fix}"
    )


# -- model.state_dict() -----------------------------------------------------------------------
def _in_order(qg: Any, t: QuantizedTensor, e: StateEntry) -> tuple[torch.Tensor, int]:
    """This rank's values of entry ``e`` in ``t``'s order (tile-major for a tile-placed tensor) and
    the first one's index: a view of the segment where aligned to the dtype, else a copy."""
    piece, size = qg.piece_of(t), e.dtype.itemsize
    if piece is None:
        return torch.empty(0, dtype=e.dtype, device=qg.device), 0
    lo, hi, off = piece.ranges[e.section]
    seg = qg.local[off : off + hi - lo]
    return (seg if off % size == 0 else seg.clone()).view(e.dtype), lo // size


def _boxes(t: QuantizedTensor, e: StateEntry, start: int, numel: int) -> list[Any]:
    """The boxes of a tile-placed tensor's entry ``e`` that its values ``[start, start + numel)`` fill."""
    assert t.tiles is not None and e.section is not None
    if e.section == 0:
        return t.tiles.boxes(*t.tiles.tile_range(start, start + numel))
    return t.tiles.scale_boxes(start, start + numel)


def _pieces(qg: Any, t: QuantizedTensor, key_prefix: str) -> dict[str, torch.Tensor]:
    """``t``'s entries on this rank: sections as PieceTensors (a tile-placed tensor's as boxes of
    whole tiles, their values copied box by box), constants as they are."""
    out: dict[str, torch.Tensor] = {}
    for e in t.entries:
        if e.section is None:
            assert e.constant is not None
            out[e.name] = e.constant.detach()
            continue
        local, start = _in_order(qg, t, e)
        name, pg = key_prefix + e.name, qg.process_group
        if t.tiles is None:
            out[e.name] = PieceTensor(local, start, e.shape, name=name, process_group=pg)
            continue
        if e.section == 0:  # float8 values: permuted as bytes
            first, stop = t.tiles.tile_range(start, start + local.numel())
            local = t.tiles.to_boxes(local.view(torch.uint8), first, stop).view(e.dtype)
        boxes = _boxes(t, e, start, local.numel())
        out[e.name] = PieceTensor(local, 0, e.shape, name=name, process_group=pg, boxes=boxes)
    return out


def _ordered(qg: Any, t: QuantizedTensor, e: StateEntry, v: Any) -> Piece | None:
    """An entry's value as a :data:`Piece` in ``t``'s order: a tile-placed tensor's PieceTensor of
    this rank's boxes back in tile-major order (None where its boxes are not this rank's)."""
    if t.tiles is None or not isinstance(v, PieceTensor) or v.is_run:
        return _as_piece(v)
    want, start = _in_order(qg, t, e)
    if [(b.offsets, b.sizes) for b in v.boxes] != [tuple(x) for x in _boxes(t, e, start, want.numel())]:
        return None
    local = v.to_local()
    if e.section == 0 and local.dtype == e.dtype:
        first, stop = t.tiles.tile_range(start, start + local.numel())
        local = t.tiles.from_boxes(local.view(torch.uint8), first, stop).view(e.dtype)
    return local, start, tuple(v.shape)


def quantized_entries(module: nn.Module, qg: Any, state_dict: dict[str, Any], prefix: str) -> None:
    """Put every quantized tensor's entries into ``module``'s ``state_dict`` (post hook): existing
    names replaced in place, new ones after their module's own parameters and buffers (where
    bitsandbytes puts its quant state)."""
    names = _module_names(module)
    position = {k: i for i, k in enumerate(state_dict)}
    replace: dict[str, torch.Tensor] = {}
    after: dict[str | None, list[tuple[str, torch.Tensor]]] = {}
    for t in qg.tensors:
        for p in _prefixes(t, names, prefix):
            own = [p + k for ref in t.refs for k in (*ref.module._parameters, *ref.module._buffers)]
            anchor = max((k for k in own if k in position), key=position.__getitem__, default=None)
            for name, value in _pieces(qg, t, p).items():
                if p + name in position:
                    replace[p + name] = value
                else:
                    after.setdefault(anchor, []).append((p + name, value))
    items = list(state_dict.items())
    state_dict.clear()
    for k, v in items:
        state_dict[k] = replace.get(k, v)
        state_dict.update(after.pop(k, []))
    for rest in after.values():
        state_dict.update(rest)


# -- full state dict --------------------------------------------------------------------------
def _typed(t: QuantizedTensor, raw: list[torch.Tensor]) -> list[torch.Tensor]:
    """Full byte sections as tensors of the format's shapes and dtypes."""
    out = []
    for g, b in zip(t.gathered, raw, strict=True):
        full = torch.empty(g.shape, dtype=g.dtype, device=b.device)
        byte_view(full).copy_(b)
        out.append(full)
    return out


def default_full(t: QuantizedTensor, sections: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries themselves, sections whole, constants cloned."""
    return {e.name: sections[e.section] if e.section is not None else e.constant.clone() for e in t.entries}  # type: ignore[union-attr]


@torch.no_grad()
def full_quantized_entries(model: nn.Module, states: list[tuple[str, Any]]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The unsharded model's entries of every quantized tensor under ``model`` by full name, and
    every name the sharded entries use (collective: one all-gather per frozen quantized buffer set)."""
    names = _module_names(model)
    full: dict[str, torch.Tensor] = {}
    owned: set[str] = set()
    for _, st in states:
        qg = frozen_buffers(st)
        if qg is None:
            continue
        for t, raw in zip(qg.tensors, qg.full_sections(), strict=True):
            sections = _typed(t, raw)
            values = t.to_full(sections) if t.to_full is not None else default_full(t, sections)
            for p in _prefixes(t, names, ""):
                full |= {p + n: v for n, v in values.items()}
                owned |= {p + e.name for e in t.entries}
    return full, owned


# -- model.load_state_dict() ------------------------------------------------------------------
def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(byte_view(a.contiguous()), byte_view(b.contiguous()))
    )


Piece = tuple[torch.Tensor, int, tuple[int, ...]]  # one rank's values, their first element, the global shape


def _as_piece(v: Any) -> Piece | None:
    return (v.to_local(), v.local_start, tuple(v.shape)) if isinstance(v, PieceTensor) else None


_PIECES_FIX = (
    "load entries of this model: model.state_dict() through torch.distributed.checkpoint (dcp.load moves pieces "
    "between world sizes), or full entries (blockshard.full_state_dict, an unsharded model's state_dict())"
)


def _from_pieces(
    qg: Any, t: QuantizedTensor, values: dict[str, Any], p: str, pieces: dict[str, Piece | None], fix: str
) -> list[torch.Tensor]:
    """This rank's bytes of every section from pieces (``pieces``: each entry of ``values`` as a
    :data:`Piece`, ``None`` if it is none) that must be this rank's own."""
    piece = qg.piece_of(t)
    out: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * len(t.sections)
    for e in t.entries:
        if e.section is None:
            continue
        got = pieces[e.name]
        lo, hi, _ = piece.ranges[e.section] if piece is not None else (0, 0, 0)
        want = (e.dtype, e.shape, lo // e.dtype.itemsize, (hi - lo) // e.dtype.itemsize)
        if got is None or (got[0].dtype, got[2], got[1], got[0].numel()) != want:
            held = _describe(values[e.name]) if got is None else _describe_piece(got)
            raise _error(
                t,
                p + e.name,
                f"it holds {held}, this rank holds piece [{want[2]}, {want[2] + want[3]}) of a {e.dtype} tensor "
                f"of shape {e.shape}",
                fix,
            )
        out[e.section] = byte_view(got[0].detach().contiguous())
    return out


def _describe_piece(piece: Piece) -> str:
    local, start, shape = piece
    return f"piece [{start}, {start + local.numel()}) of a {local.dtype} tensor of shape {shape}"


def _describe(v: Any) -> str:
    if isinstance(v, PieceTensor) and not v.is_run:
        shown = [(b.offsets, b.sizes) for b in v.boxes[:3]]
        more = "..." if len(v.boxes) > 3 else ""
        return f"a piece of {len(v.boxes)} boxes {shown}{more} of a {v.dtype} tensor of shape {tuple(v.shape)}"
    if (piece := _as_piece(v)) is not None:
        return _describe_piece(piece)
    if isinstance(v, torch.Tensor):
        return f"a {type(v).__name__} of dtype {v.dtype} and shape {tuple(v.shape)}"
    return f"a {type(v).__name__}"


def _from_full(qg: Any, t: QuantizedTensor, values: dict[str, Any], p: str) -> list[torch.Tensor]:
    """This rank's bytes of every section from the unsharded model's entries."""
    if t.from_full is not None:
        sections = t.from_full(values)
    else:
        sections = [torch.empty(0)] * len(t.sections)
        for e in t.entries:
            if e.section is not None:
                sections[e.section] = values[e.name]
    piece = qg.piece_of(t)
    out = []
    for k, (s, v) in enumerate(zip(t.sections, sections, strict=True)):
        g = t.gathered[k]
        if not isinstance(v, torch.Tensor) or isinstance(v, PieceTensor) or (v.dtype, v.shape) != (g.dtype, g.shape):
            raise _error(
                t,
                f"{p}{t.full_names[0] if t.full_names else t.entries[0].name} ({s.name})",
                f"it holds {_describe(v)}, the model's {s.name} is a {g.dtype} tensor of shape {tuple(g.shape)}",
                "load a state dict of this model, quantized the same way (blockshard.full_state_dict, an unsharded "
                "model's state_dict(), or model.state_dict() through torch.distributed.checkpoint)",
            )
        lo, hi, _ = piece.ranges[k] if piece is not None else (0, 0, 0)
        out.append(t.take_section(k, byte_view(v.detach().contiguous()), lo, hi))
    return out


def _check_constants(t: QuantizedTensor, values: dict[str, Any], p: str) -> None:
    for e in t.entries:
        v = values.get(e.name)
        if e.section is None and v is not None and not (isinstance(v, torch.Tensor) and _same(v, e.constant)):  # type: ignore[arg-type]
            raise _error(
                t,
                p + e.name,
                f"it holds {_describe(v)} that differs from the model's quant state (a {e.dtype} tensor of shape "
                f"{e.shape})",
                "load a state dict of a model quantized the same way (same quant_type, blocksize, nested statistics "
                "and weights)",
            )


def _placed(
    module: nn.Module, qg: Any, state: Mapping[str, Any], prefix: str
) -> Iterator[tuple[QuantizedTensor, list[str], str]]:
    """``(tensor, its state-dict prefixes, the one its entries are found under in state)`` for every
    quantized tensor of ``module``'s group."""
    names = _module_names(module)
    for t in qg.tensors:
        prefixes = _prefixes(t, names, prefix)
        if prefixes:
            yield t, prefixes, next((q for q in prefixes if q + t.entries[0].name in state), prefixes[0])


@torch.no_grad()
def load_quantized(
    module: nn.Module, qg: Any, state_dict: dict[str, Any], prefix: str, missing_keys: list[str]
) -> None:
    """Load pre hook: copy every quantized tensor's bytes from ``state_dict`` into this rank's
    segment, then leave the module's own parameters their current values (so ``nn.Module`` copies
    nothing) and drop the other entries. The group must be sharded."""
    for t, prefixes, p in _placed(module, qg, state_dict, prefix):
        weight = state_dict.get(p + t.entries[0].name)
        pieces = isinstance(weight, PieceTensor)
        wanted = [e.name for e in t.entries] if pieces or not t.full_names else list(t.full_names)
        absent = [p + n for n in wanted if p + n not in state_dict]
        if absent:
            missing_keys.extend(k for k in absent if k not in missing_keys)
        else:
            values = {n: state_dict[p + n] for n in {e.name for e in t.entries} | set(wanted) if p + n in state_dict}
            _check_constants(t, values, p)
            if pieces:
                by_name = {e.name: e for e in t.entries}
                ordered = {
                    n: _ordered(qg, t, by_name[n], v) if n in by_name else _as_piece(v) for n, v in values.items()
                }
                incoming = _from_pieces(qg, t, values, p, ordered, _PIECES_FIX)
            else:
                incoming = _from_full(qg, t, values, p)
            qg.write_piece(t, incoming)
        for q in prefixes:
            _settle(t, state_dict, q)


def _settle(t: QuantizedTensor, state_dict: dict[str, Any], p: str) -> None:
    """After loading: the module's parameters' entries hold their own values, the others are gone."""
    params = {ref.attr: ref.module._parameters[ref.attr] for ref in t.refs} | {
        ref.attr: ref.module._parameters[ref.attr] for refs, _ in t.extra for ref in refs
    }
    for name in {e.name for e in t.entries} | set(t.full_names):
        if p + name not in state_dict:
            continue
        if (param := params.get(name)) is not None:
            state_dict[p + name] = param.detach()
        else:
            del state_dict[p + name]


# -- blockshard.sharded_state_dict / load_sharded_state_dict / load_full_state_dict ----------------
def _order(t: QuantizedTensor) -> str:
    return t.tiles.name if t.tiles is not None else "row-major"


def quantized_pieces(
    module: nn.Module, qg: Any, prefix: str
) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...], str]]:
    """This rank's entries of every quantized tensor of ``module``'s group by the names of
    ``module.state_dict(prefix=prefix)``: sections as this rank's :data:`Piece` and its order
    (``"row-major"``, or ``"tile-major R x C"`` for a tile-placed tensor), constants whole (their
    piece is the whole tensor)."""
    names = _module_names(module)
    out: dict[str, tuple[torch.Tensor, int, tuple[int, ...], str]] = {}
    for t in qg.tensors:
        for p in _prefixes(t, names, prefix):
            for e in t.entries:
                if e.section is None:
                    assert e.constant is not None
                    out[p + e.name] = (e.constant.detach(), 0, tuple(e.constant.shape), "row-major")
                else:
                    out[p + e.name] = (*_in_order(qg, t, e), e.shape, _order(t))
    return out


@torch.no_grad()
def load_quantized_pieces(module: nn.Module, qg: Any, state: Mapping[str, Any], prefix: str, *, full: bool) -> None:
    """Copy this rank's bytes of every quantized tensor of ``module``'s group from ``state``: pieces
    of the same layout (:data:`Piece` values with their order, as :func:`quantized_pieces` gives them) or, with
    ``full``, the unsharded model's entries (any world size). The group must be sharded."""
    for t, _, p in _placed(module, qg, state, prefix):
        wanted = list(t.full_names) if full and t.full_names else [e.name for e in t.entries]
        absent = [p + n for n in wanted if p + n not in state]
        if absent:
            what = "full entries" if full else "this rank's pieces (blockshard.sharded_state_dict)"
            raise _error(t, absent[0], f"the state has no such entry (it holds {what} of another model)", _LOAD_FIX)
        if full:
            values = {n: state[p + n] for n in {e.name for e in t.entries} | set(wanted) if p + n in state}
            _check_constants(t, values, p)
            qg.write_piece(t, _from_full(qg, t, values, p))
            continue
        values = {e.name: state[p + e.name][0] for e in t.entries}
        _check_constants(t, values, p)
        for e in t.entries:
            got = state[p + e.name][3] if len(state[p + e.name]) > 3 else "row-major"
            if e.section is not None and got != _order(t):
                raise _error(
                    t,
                    p + e.name,
                    f"it holds a piece in {got} order, this rank's piece of it is in {_order(t)} order (the weight "
                    "was sharded with another tile_placement)",
                    "load pieces saved by blockshard.sharded_state_dict of a model sharded the same way, or full "
                    "entries with load_full_state_dict",
                )
        pieces = {e.name: state[p + e.name][:3] for e in t.entries}
        fix = (
            "load the pieces at the world size and layout they were saved at, or full entries with load_full_state_dict"
        )
        qg.write_piece(t, _from_pieces(qg, t, values, p, pieces, fix))


_LOAD_FIX = (
    "load what blockshard.sharded_state_dict (same world size) or blockshard.full_state_dict (any world size) "
    "gave for this model"
)


def full_entries_of(model: nn.Module, state: dict[str, Any], states: list[tuple[str, Any]]) -> dict[str, Any]:
    """``state`` (its PieceTensors gathered) with the quantized tensors' entries replaced by the
    unsharded model's (torchao's subclasses whole again; collective). Dropped values (``None``:
    a rank that keeps nothing) stay dropped."""
    if not any(frozen_buffers(st) is not None for _, st in states):
        return state
    full, owned = full_quantized_entries(model, states)
    out: dict[str, Any] = {}
    for k, v in state.items():
        if k in owned and k not in full:
            continue
        out[k] = full[k] if k in full and v is not None else v
    return out
