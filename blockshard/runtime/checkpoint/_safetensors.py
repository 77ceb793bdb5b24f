"""Load Hugging Face safetensors weights straight into a sharded model's local pieces.

[Note: sharded loading]
``load_safetensors(model, path)`` fills every rank's pieces from a ``.safetensors`` file, a
directory holding ``model.safetensors``, or a checkpoint split over several files with
``model.safetensors.index.json`` (what ``save_pretrained`` writes). A piece is a run of elements
of a tensor's row-major flattening; it is read as at most ``2 * ndim - 1`` boxes of the tensor
(a partial first row, whole rows, a partial last row, recursively), each one lazy slice of
``safe_open(...).get_slice(name)``, so a rank reads exactly its own elements: never a whole
tensor it does not hold, never the whole model. Tied parameters (HF saves one of the names, e.g.
``model.embed_tokens.weight`` for a tied ``lm_head.weight``) load from whichever name the
checkpoint has. Parameters outside any group and persistent buffers are read whole (every rank
holds them whole). Values are cast to the model's dtypes. Works on a model sharded on the meta
device after ``model.to_empty(device=...)``; no collective is issued (call it on every rank).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from blockshard._errors import CheckpointError, ShardingError
from blockshard.runtime.checkpoint._export import CHECKSUMS
from blockshard.runtime.checkpoint._integrity import hash_file
from blockshard.runtime.checkpoint._state_dict import _names
from blockshard.runtime.core._common import ShardedState
from blockshard.runtime.core._inspect import join_name, states_under

__all__ = ["LoadReport", "load_safetensors"]

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_safetensors` did on this rank: tensor bytes read (``read_bytes``, its own
    pieces plus the tensors held whole) and the names filled."""

    read_bytes: int
    loaded: tuple[str, ...]


def _files(path: str | os.PathLike[str]) -> tuple[dict[str, str], dict[str, Any]]:
    """Checkpoint tensor name -> file, from one file, a directory's index, or its files; and the
    files' recorded checksums (a blockshard export's index holds them; else none)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        if os.path.exists(index):
            return _index(path, index)
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ShardingError(f"load_safetensors: {path!r} holds no {INDEX} and no .safetensors file")
        paths = [os.path.join(path, f) for f in files]
    elif os.path.isfile(path):
        paths = [path]
    else:
        raise ShardingError(f"load_safetensors: {path!r} is neither a .safetensors file nor a directory")
    out: dict[str, str] = {}
    for p in paths:
        for name in _keys(p):
            if name in out:
                raise CheckpointError(
                    f"load_safetensors: tensor {name!r} is in both {out[name]!r} and {p!r}, and {path!r} has no {INDEX} "
                    "to say which to load. Fix: remove the stale file, or write an index (save_pretrained does)"
                )
            out[name] = p
    return out, {}


def _keys(file: str) -> list[str]:
    from safetensors import safe_open

    with _named(file):
        with safe_open(file, framework="pt") as f:
            return list(f.keys())


def _index(path: str, index: str) -> tuple[dict[str, str], dict[str, Any]]:
    """The index's ``weight_map``, checked: a JSON object mapping tensor names to files that exist;
    and the checksums a blockshard export recorded in its metadata (file path -> bytes, CRC-32)."""
    fix = f"Fix: write the index again (save_pretrained does), or remove it to load the {path!r}'s files as they are"
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"load_safetensors: {index!r} cannot be read ({type(e).__name__}: {e}). {fix}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"load_safetensors: {index!r} has no weight_map of tensor names to file names (an object of strings). {fix}"
        )
    missing = sorted({v for v in weight_map.values() if not os.path.isfile(os.path.join(path, v))})
    if missing:
        raise CheckpointError(f"load_safetensors: {index!r} names files that are not in {path!r}: {missing[:5]}. {fix}")
    sums = (data.get("metadata") or {}).get(CHECKSUMS) if isinstance(data.get("metadata"), dict) else None
    sums = {os.path.join(path, f): v for f, v in sums.items()} if isinstance(sums, dict) else {}
    return {name: os.path.join(path, file) for name, file in weight_map.items()}, sums


@contextlib.contextmanager
def _named(file: str) -> Iterator[None]:
    """safetensors' errors (which name no file) as :class:`CheckpointError` naming ``file``."""
    try:
        yield
    except (CheckpointError, ShardingError):
        raise
    except Exception as e:  # SafetensorError, OSError, a truncated file's errors
        raise CheckpointError(
            f"load_safetensors: {file!r} cannot be read ({type(e).__name__}: {e}): it is damaged, truncated or not a "
            "safetensors file. Fix: write it again (blockshard.save_pretrained or save_pretrained)"
        ) from None


def row_boxes(shape: tuple[int, ...], lo: int, hi: int) -> Iterator[tuple[slice, ...]]:
    """Boxes (index tuples of slices) covering elements ``[lo, hi)`` of the row-major flattening
    of a tensor of ``shape``, in order: at most ``2 * len(shape) - 1`` of them."""
    if hi <= lo:
        return
    if len(shape) <= 1:
        yield (slice(lo, hi),)
        return
    row = math.prod(shape[1:])
    r0, o0 = divmod(lo, row)
    r1, o1 = divmod(hi, row)
    if r0 == r1:
        for box in row_boxes(shape[1:], o0, o1):
            yield (slice(r0, r0 + 1), *box)
        return
    if o0:
        for box in row_boxes(shape[1:], o0, row):
            yield (slice(r0, r0 + 1), *box)
        r0 += 1
    if r1 > r0:
        yield (slice(r0, r1),)
    if o1:
        for box in row_boxes(shape[1:], 0, o1):
            yield (slice(r1, r1 + 1), *box)


class _Reader:
    """Open files (one handle each) and count the bytes read through them."""

    def __init__(self, files: dict[str, str], sums: dict[str, Any]) -> None:
        self.files, self.read_bytes, self.sums = files, 0, sums
        self._open: dict[str, object] = {}

    def _handle(self, name: str) -> Any:  # a safetensors safe_open (its methods are unannotated)
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._open:
            if path in self.sums:
                _verify(path, self.sums[path])
            with _named(path):
                self._open[path] = safe_open(path, framework="pt")
        return self._open[path]

    def shape(self, name: str) -> tuple[int, ...]:
        with _named(self.files[name]):
            return tuple(self._handle(name).get_slice(name).get_shape())

    def run(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of tensor ``name``'s flattening, read box by box."""
        with _named(self.files[name]):
            sl = self._handle(name).get_slice(name)
            parts = [sl[box].reshape(-1) for box in row_boxes(self.shape(name), lo, hi)]
        out = torch.cat(parts) if len(parts) != 1 else parts[0]
        self.read_bytes += out.numel() * out.element_size()
        return out

    def boxes(self, name: str, boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> torch.Tensor:
        """The values of tensor ``name`` in ``boxes`` (``(offsets, sizes)``), box after box, each row-major."""
        with _named(self.files[name]):
            sl = self._handle(name).get_slice(name)
            parts = [
                sl[tuple(slice(o, o + n) for o, n in zip(off, size, strict=True))].reshape(-1) for off, size in boxes
            ]
        out = torch.cat(parts) if len(parts) != 1 else parts[0]
        self.read_bytes += out.numel() * out.element_size()
        return out

    def whole(self, name: str) -> torch.Tensor:
        with _named(self.files[name]):
            t: torch.Tensor = self._handle(name).get_tensor(name)
        self.read_bytes += t.numel() * t.element_size()
        return t


def _verify(file: str, want: Any) -> None:
    """A file of a blockshard export against the size and CRC-32 its index recorded."""
    got = hash_file(file)
    if not isinstance(want, dict) or (got["bytes"], got["crc32"]) != (want.get("bytes"), want.get("crc32")):
        raise CheckpointError(
            f"load_safetensors: {file!r} does not match the size and CRC-32 its {INDEX} recorded ({got['bytes']} bytes, "
            "its bytes changed since the export). Fix: export it again, or pass verify=False to load it as it is"
        )


@torch.no_grad()
def load_safetensors(
    model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True, verify: bool = True
) -> LoadReport:
    """Fill a sharded model from Hugging Face safetensors, each rank reading only its pieces (see
    [Note: sharded loading]). ``strict``: every parameter and persistent buffer of the model must
    be in the checkpoint (under one of its names); names the model lacks are ignored. ``verify``:
    a file of a ``blockshard.save_pretrained`` export is checked against the CRC-32 its index
    recorded before it is read (each rank reads each file it loads from once in full more)."""
    files, sums = _files(path)
    reader = _Reader(files, sums if verify else {})
    loaded: list[str] = []
    missing: list[str] = []
    managed: set[int] = set()
    for prefix, st in states_under(model):
        g = st.buffers
        if g.layout is None:
            continue
        if g.device.type == "meta":
            raise ShardingError(
                f"load_safetensors: group {g.name!r} is on the meta device; call model.to_empty(device=...) first"
            )
        if g.sharded_state is not ShardedState.SHARDED:
            g.reshard()
        names: dict[int, list[str]] = {}
        for name, sp in _names(st.module, g.params):
            names.setdefault(id(sp), []).append(join_name(prefix, name))
        for sp in g.params:
            managed |= {id(sp.sharded), id(sp.unsharded)}
            found = next((n for n in names.get(id(sp), []) if n in reader.files), None)
            if found is None:
                missing += names.get(id(sp), [join_name(prefix, sp.fqn)])[:1]
                continue
            tp = sp.tp if sp.tp is not None and sp.tp.cut else None
            shape = tuple(tp.shape) if tp is not None else tuple(sp.shape)  # a TP parameter: its global shape
            if reader.shape(found) != shape:
                raise ShardingError(
                    f"load_safetensors: {found!r} has shape {reader.shape(found)} in the checkpoint, the model's "
                    f"parameter has {shape}. Fix: load a checkpoint of this model's configuration"
                )
            if sp.local_numel and tp is not None:  # this rank's piece of the TP-local tensor, as global boxes
                tp_boxes = tp.boxes(tuple(sp.shape), sp.local_start, sp.local_numel)
                sp.sharded.copy_(reader.boxes(found, tp_boxes).view(sp.sharded.shape))
            elif sp.local_numel and (boxes := sp.piece_boxes()) is not None:  # [Note: packed tile order in the engine]
                sp.sharded.copy_(sp.from_boxed(reader.boxes(found, boxes)))
            elif sp.local_numel:
                piece = reader.run(found, sp.local_start, sp.local_start + sp.local_numel)
                sp.sharded.copy_(piece.view(sp.sharded.shape))
            loaded.append(found)
    _load_whole(model, reader, managed, loaded, missing)
    if strict and missing:
        raise ShardingError(
            f"load_safetensors: {len(missing)} of the model's tensors are not in the checkpoint at {os.fspath(path)!r}: "
            f"{missing[:5]}. Fix: load a checkpoint of this model, or pass strict=False to leave them as they are"
        )
    return LoadReport(reader.read_bytes, tuple(loaded))


def _load_whole(model: nn.Module, reader: _Reader, managed: set[int], loaded: list[str], missing: list[str]) -> None:
    """Parameters outside any group and persistent buffers: read whole, copied in place."""
    persistent = {
        join_name(p, n) for p, m in model.named_modules() for n in m._buffers if n not in m._non_persistent_buffers_set
    }
    by_id: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(t) not in managed and (isinstance(t, nn.Parameter) or name in persistent):
            by_id.setdefault(id(t), (t, []))[1].append(name)
    for t, names in by_id.values():
        found = next((n for n in names if n in reader.files), None)
        if found is None:
            missing.append(names[0])
            continue
        value = reader.whole(found)
        if tuple(value.shape) != tuple(t.shape):
            raise ShardingError(
                f"load_safetensors: {found!r} has shape {tuple(value.shape)}, the model's {tuple(t.shape)}"
            )
        t.copy_(value)
        loaded.append(found)
