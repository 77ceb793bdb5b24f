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

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from blockshard._errors import ShardingError
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


def _files(path: str | os.PathLike) -> dict[str, str]:
    """Checkpoint tensor name -> file, from one file, a directory's index, or its files."""
    from safetensors import safe_open

    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            return {name: os.path.join(path, file) for name, file in weight_map.items()}
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
        with safe_open(p, framework="pt") as f:
            out |= dict.fromkeys(f.keys(), p)
    return out


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

    def __init__(self, files: dict[str, str]) -> None:
        self.files, self.read_bytes = files, 0
        self._open: dict[str, object] = {}

    def _handle(self, name: str):
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def run(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of tensor ``name``'s flattening, read box by box."""
        sl = self._handle(name).get_slice(name)
        parts = [sl[box].reshape(-1) for box in row_boxes(self.shape(name), lo, hi)]
        out = torch.cat(parts) if len(parts) != 1 else parts[0]
        self.read_bytes += out.numel() * out.element_size()
        return out

    def whole(self, name: str) -> torch.Tensor:
        t = self._handle(name).get_tensor(name)
        self.read_bytes += t.numel() * t.element_size()
        return t


@torch.no_grad()
def load_safetensors(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> LoadReport:
    """Fill a sharded model from Hugging Face safetensors, each rank reading only its pieces (see
    [Note: sharded loading]). ``strict``: every parameter and persistent buffer of the model must
    be in the checkpoint (under one of its names); names the model lacks are ignored."""
    reader = _Reader(_files(path))
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
            if reader.shape(found) != sp.shape:
                raise ShardingError(
                    f"load_safetensors: {found!r} has shape {reader.shape(found)} in the checkpoint, the model's "
                    f"parameter has {sp.shape}. Fix: load a checkpoint of this model's configuration"
                )
            if sp.local_numel:
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
