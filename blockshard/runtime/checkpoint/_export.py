"""Streamed full-model export: Hugging Face safetensors written one group at a time.

[Note: streamed export]
``model.save_pretrained(path, state_dict=blockshard.full_state_dict(model))`` holds the whole
model on every rank (``full_state_dict`` gathers every group and keeps the full tensors).
:func:`save_pretrained` (collective) instead writes one safetensors shard per group from rank 0,
streamed: the header first (every tensor's shape and place is known without data), then the
gathered buffer's elements in order, which is each bucket's segments rank after rank. Rank 0
writes its own segment straight from its local buffer and receives every other rank's in chunks
of at most ``_CHUNK_BYTES`` (point-to-point, into one reused buffer), writing each chunk's part
that belongs to a tensor; the other ranks send views of their local buffers. No rank gathers a
group: rank 0 holds one chunk beyond its shard, the others nothing (an all-gather held the group
plus gloo's own copy of it on every rank). Tensors outside every group (buffers, unsharded
parameters) go into a last shard. Rank 0 also writes ``model.safetensors.index.json`` (the name
-> shard map ``from_pretrained`` reads) and, for a Hugging Face model, its ``config.json``. Tied
parameters are written once, under their first name (``from_pretrained`` ties the others again,
as for Hugging Face's own ``save_pretrained``). Quantized weights (bitsandbytes 4-bit, blockwise
FP8) go into a shard of their own under the unsharded model's state-dict names (bitsandbytes'
serialization keys, [Note: quantized state dicts]), streamed the same way: entry by entry, each
section's bytes rank after rank (its units are in rank order), rank 0 receiving every other rank's
piece in chunks of at most ``_CHUNK_BYTES``; replicated constants (code tables, the packed quant
state) come from rank 0's own. A master in packed tile order ([Note: packed tile order in the engine])
is collected whole on rank 0 from its gathered run and written row-major (one such parameter at a
time). A tile-placed FP8 weight's pieces are runs of tiles, not of the
row-major entry ([Note: tile placement in the engine]), so rank 0 puts each rank's piece at its
tiles' places in one buffer of the entry (one weight, or its scales) and writes that. torchao's
tensor subclasses raise before anything is written.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from blockshard._errors import QuantizedWeightError
from blockshard.runtime.checkpoint._files import raise_on_every_rank
from blockshard.runtime.checkpoint._piece_tensor import PieceTensor
from blockshard.runtime.checkpoint._quantized_state import StateEntry, _module_names, _prefixes
from blockshard.runtime.checkpoint._state_dict import _names, full_state_dict
from blockshard.runtime.core._inspect import BuffersView, agree_on_call, checkpoint_states, join_name, states_under
from blockshard.runtime.core._param import ShardedParam
from blockshard.runtime.core._state import ModuleState
from blockshard.runtime.quantized._frozen import frozen_buffers

__all__ = ["save_pretrained"]

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
INDEX = "model.safetensors.index.json"
CHECKSUMS = "blockshard_files"  # the index's metadata key: every file's bytes and CRC-32
_CHUNK_BYTES = 16 << 20  # the most rank 0 receives at once ([Note: streamed export])


def _header(tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> tuple[bytes, int]:
    """The safetensors header (an 8-byte length, the JSON, padded to 8 bytes) for tensors of
    ``(dtype, shape)`` stored one after another in this order; and the bytes of tensor data."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header | {"__metadata__": {"format": "pt"}}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offset


class _Sink:
    """Rank 0's writes of one export: a failed open or write (a full disk, a path under a file) is
    kept, and later writes are skipped, so rank 0 still receives every chunk the other ranks send
    (the protocol runs to its end instead of leaving them blocked) and the failure is raised on
    every rank at the end ([Note: streamed export])."""

    def __init__(self) -> None:
        self.error: OSError | None = None
        self._file: Any = None
        self._crc, self._size = 0, 0
        self.sums: dict[str, dict[str, int]] = {}  # file name -> bytes and CRC-32 of what was written

    @contextlib.contextmanager
    def open(self, path: str) -> Iterator[_Sink]:
        if self.error is None:
            try:
                self._file = open(path, "wb")
            except OSError as e:
                self.error = e
        self._crc, self._size = 0, 0
        try:
            yield self
        finally:
            if self._file is not None:
                try:
                    self._file.close()
                except OSError as e:
                    self.error = self.error or e
                self._file = None
                self.sums[os.path.basename(path)] = {"bytes": self._size, "crc32": self._crc}

    def write(self, data: Any) -> None:
        if self._file is not None and self.error is None:
            try:
                self._file.write(data)
            except OSError as e:
                self.error = e
                return
            view = memoryview(data).cast("B")
            self._crc, self._size = zlib.crc32(view, self._crc), self._size + len(view)


def _write_bytes(f: Any, t: torch.Tensor) -> None:
    if t.numel():
        f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def _write_safetensors(sink: _Sink, path: str, tensors: dict[str, torch.Tensor]) -> int:
    """The safetensors format, written from the tensors' own memory; returns the bytes of tensor data."""
    header, total = _header({k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()})
    with sink.open(path) as f:
        f.write(header)
        for t in tensors.values():
            _write_bytes(f, t)
    return total


def _rank(model: nn.Module) -> int:
    import torch.distributed as dist

    states = checkpoint_states(model, "export")
    if not dist.is_initialized() or not states:
        return 0
    return dist.get_rank(states[0][1].buffers.process_group)


@torch.no_grad()
def save_pretrained(model: nn.Module, save_directory: str | os.PathLike[str]) -> None:
    """Write the full weights of a sharded model as Hugging Face safetensors shards (plus the index
    and, for a Hugging Face model, ``config.json``) from rank 0, one group at a time, streamed in
    chunks (collective: call on every rank; see [Note: streamed export]). ``from_pretrained``
    loads it."""
    path = os.fspath(save_directory)
    agree_on_call(model, "blockshard.save_pretrained")  # [Note: collective headers]
    if any(sp.tp is not None for _, st in states_under(model) for sp in st.buffers.params):
        _save_gathered(model, path)  # [Note: tensor-parallel export]
        return
    rank = _rank(model)
    states = checkpoint_states(model, "export")
    _check_exportable(states)  # before any collective or file
    groups = [(prefix, st) for prefix, st in states if st.buffers.layout is not None]
    state = model.state_dict()
    quantized = _quantized_entries(model, states)  # [Note: quantized state dicts]
    owned = {name for name, *_ in quantized}
    quantized = [q for q in quantized if q[0] in state]
    rest = {
        k: v
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and not isinstance(v, PieceTensor) and k not in owned
    }
    n_files = len(groups) + bool(quantized) + bool(rest)
    files = [f"model-{i + 1:05d}-of-{n_files:05d}.safetensors" for i in range(n_files)]
    pg = states[0][1].buffers.process_group if states and dist.is_initialized() else None
    error = None
    if rank == 0:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            error = _export_error(path, e)
    raise_on_every_rank(pg, error)  # before any byte is sent
    sink, weight_map = _Sink(), dict[str, str]()
    total, written = 0, set[int]()
    for file, (prefix, st) in zip(files, groups, strict=False):
        tensors = _chosen(prefix, st, set(state), written)
        total += _stream_group(sink, os.path.join(path, file), st.buffers, tensors, rank)
        weight_map |= dict.fromkeys(tensors, file)
    if quantized:  # bitsandbytes' serialization keys, as the unsharded model's state_dict()
        total += _stream_quantized(sink, os.path.join(path, files[len(groups)]), quantized, rank)
        weight_map |= dict.fromkeys((name for name, *_ in quantized), files[len(groups)])
    if rank == 0 and rest:
        unique = _unique(rest)
        total += _write_safetensors(sink, os.path.join(path, files[-1]), unique)
        weight_map |= dict.fromkeys(unique, files[-1])
    if rank == 0 and sink.error is None:
        try:
            _write_index(model, path, total, sink, weight_map)
        except OSError as e:
            sink.error = e
    raise_on_every_rank(pg, None if sink.error is None else _export_error(path, sink.error))


def _save_gathered(model: nn.Module, path: str) -> None:
    """[Note: tensor-parallel export]
    A model with tensor-parallel groups is exported from its full state dict
    (:func:`~blockshard.full_state_dict`: every group gathered over dp, then the TP parameters over
    tp, on every rank), written by global rank 0 as one safetensors file with the index (its
    checksums, [Note: checkpoint integrity]) and, for a Hugging Face model, ``config.json``: the
    whole model passes through each rank's memory once, as torch's full state dict does, instead of
    the group-by-group stream of [Note: streamed export]. Collective over every rank."""
    full = full_state_dict(model)
    error = None
    if dist.get_rank() == 0:
        tensors = _unique({k: v for k, v in full.items() if isinstance(v, torch.Tensor)})
        file = "model-00001-of-00001.safetensors"
        sink = _Sink()
        try:
            os.makedirs(path, exist_ok=True)
            total = _write_safetensors(sink, os.path.join(path, file), tensors)
            if sink.error is not None:
                raise sink.error
            _write_index(model, path, total, sink, dict.fromkeys(tensors, file))
        except OSError as e:
            error = _export_error(path, e)
    raise_on_every_rank(dist.group.WORLD, error)


def _write_index(model: nn.Module, path: str, total: int, sink: _Sink, weight_map: dict[str, str]) -> None:
    """The export's last files (rank 0): the safetensors index, with the byte count and the files'
    checksums ([Note: checkpoint integrity]), and, for a Hugging Face model, ``config.json``."""
    with open(os.path.join(path, INDEX), "w") as f:
        metadata = {"total_size": total, CHECKSUMS: sink.sums}
        json.dump({"metadata": metadata, "weight_map": weight_map}, f, indent=2)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(path)


def _export_error(path: str, e: OSError) -> str:
    return (
        f"save_pretrained({path!r}) failed on rank 0: {type(e).__name__}: {e}. The export there is incomplete. "
        "Fix: free space or fix the path (a directory, writable), then export again"
    )


def _check_exportable(states: list[tuple[str, ModuleState | BuffersView]]) -> None:
    """Raise before anything is written if a quantized weight's full entry is a tensor subclass
    (torchao ``NF4Tensor``, ``MXTensor``), which safetensors cannot hold."""
    for prefix, st in states:
        fq = frozen_buffers(st)
        for t in fq.tensors if fq is not None else ():
            if t.to_full is not None:
                raise QuantizedWeightError(
                    f"blockshard.save_pretrained: quantized weight {join_name(prefix, t.fqn)!r} of group {st.buffers.name!r} is a "
                    f"{t.format} (a tensor subclass), which safetensors cannot hold, and its library has no "
                    "safetensors serialization. Fix: save a checkpoint with blockshard.save_checkpoint (or "
                    "dcp.save(model.state_dict())), or save the adapters only (peft's save_pretrained)"
                )


def _chosen(prefix: str, st: Any, names: set[str], written: set[int]) -> dict[str, ShardedParam]:
    """A group's parameters to write by name (those in the state dict, tied ones once), in the
    order of the gathered buffer."""
    out = {}
    for name, sp in _names(st.module, st.buffers.params):
        key = join_name(prefix, name)
        if key in names and id(sp) not in written:
            written.add(id(sp))
            out[key] = sp
    return dict(sorted(out.items(), key=lambda kv: kv[1].gathered_offset))


def _stream_group(sink: _Sink, path: str, g: Any, tensors: dict[str, ShardedParam], rank: int) -> int:
    """Write one group's ``tensors`` as a safetensors file from rank 0, streamed (collective over the
    group's ranks; see [Note: streamed export]); returns the bytes of tensor data."""
    import torch.distributed as dist

    layout, W = g.layout, g.world_size
    runs = [(sp.gathered_offset, sp.gathered_offset + sp.stored_numel) for sp in tensors.values()]
    writer = _Runs(runs, list(tensors.values()))
    chunk = max(1, _CHUNK_BYTES // g.local.element_size())
    assert g.local.dtype == g.orig_dtype, (g.local.dtype, g.orig_dtype)  # the local buffer holds the values
    size = min(chunk, max(layout.buckets, default=0)) if rank == 0 and W > 1 else 0  # rank 0 receives into it
    buf = torch.empty(size, dtype=g.local.dtype, device=g.local.device)
    header, total = _header({k: (g.orig_dtype, sp.shape) for k, sp in tensors.items()})
    with sink.open(path) if rank == 0 else contextlib.nullcontext() as f:
        if f is not None:
            f.write(header)
        for b, S_b in enumerate(layout.buckets):
            off, base = layout.bucket_local_offset(b), layout.bucket_gathered_offset(b)
            for r in range(W):
                lo, hi = _span(runs, base + r * S_b, base + (r + 1) * S_b)  # gathered elements to write
                for c in range(lo, hi, chunk):
                    n = min(chunk, hi - c)
                    local = g.local[off + c - base - r * S_b :][:n]  # rank r's elements [c, c + n)
                    if rank == 0 and r == 0:
                        writer.write(f, local, c)
                    elif rank == 0:
                        dist.recv(buf[:n], group=g.process_group, group_src=r)
                        writer.write(f, buf[:n], c)
                    elif rank == r:
                        dist.send(local.contiguous(), group=g.process_group, group_dst=0)
    return total


def _quantized_entries(
    model: nn.Module, states: list[tuple[str, ModuleState | BuffersView]]
) -> list[tuple[str, Any, Any, StateEntry]]:
    """``(full name, frozen quantized buffers, tensor, entry)`` of every quantized weight's entry under
    ``model``, in ``full_state_dict``'s order (a tensor's entries under each of its names)."""
    names = _module_names(model)
    out: dict[str, tuple[str, Any, Any, StateEntry]] = {}
    for _, st in states:
        qg = frozen_buffers(st)
        for t in qg.tensors if qg is not None else ():
            for p in _prefixes(t, names, ""):
                out |= {p + e.name: (p + e.name, qg, t, e) for e in t.entries}
    return list(out.values())


def _stream_quantized(sink: _Sink, path: str, entries: list[tuple[str, Any, Any, StateEntry]], rank: int) -> int:
    """Write quantized weights' ``entries`` as a safetensors file from rank 0, streamed (collective
    over their groups' ranks; see [Note: streamed export]); returns the bytes of tensor data."""
    header, total = _header({name: (e.dtype, e.shape) for name, _, _, e in entries})
    bufs: dict[int, torch.Tensor] = {}  # rank 0's receive buffer of each group
    with sink.open(path) if rank == 0 else contextlib.nullcontext() as f:
        if f is not None:
            f.write(header)
        for _, qg, t, e in entries:
            if e.section is None:
                assert e.constant is not None
                if f is not None:
                    _write_bytes(f, e.constant)
                continue
            index = qg.tensors.index(t)
            held = [
                (r, p.ranges[e.section])
                for r, pieces in enumerate(qg.layout.pieces)
                for p in pieces
                if p.tensor == index
            ]
            if t.tiles is None:  # row-major: each rank's piece in turn is the next run of the entry
                for r, (lo, hi, off) in held:
                    _stream_bytes(functools.partial(_write_bytes, f), qg, off, off + hi - lo, r, rank, bufs)
                continue
            # tile-major pieces ([Note: tile placement in the engine]): rank 0 puts every piece's tiles
            # at their row-major places in one buffer of the entry, then writes it
            whole = torch.empty(t.sections[e.section].nbytes if rank == 0 else 0, dtype=torch.uint8, device=qg.device)
            for r, (lo, hi, off) in held:
                piece = _received(qg, off, off + hi - lo, r, rank, bufs)
                if rank == 0:
                    t.put_section(e.section, whole, piece, lo, hi)
            if f is not None:
                _write_bytes(f, whole)
    return total


def _received(qg: Any, start: int, stop: int, r: int, rank: int, bufs: dict[int, torch.Tensor]) -> torch.Tensor:
    """Bytes ``[start, stop)`` of rank ``r``'s segment of ``qg``, on rank 0 (empty on the others)."""
    out = torch.empty(stop - start if rank == 0 else 0, dtype=torch.uint8, device=qg.device)
    at = 0

    def put(b: torch.Tensor) -> None:
        nonlocal at
        out[at : at + b.numel()].copy_(b)
        at += b.numel()

    _stream_bytes(put, qg, start, stop, r, rank, bufs)
    return out


def _stream_bytes(
    out: Callable[[torch.Tensor], None],
    qg: Any,
    start: int,
    stop: int,
    r: int,
    rank: int,
    bufs: dict[int, torch.Tensor],
) -> None:
    """Bytes ``[start, stop)`` of rank ``r``'s segment of ``qg`` to ``out`` on rank 0, in chunks of at
    most ``_CHUNK_BYTES`` (received into one buffer per group, ``bufs``); rank ``r`` sends them."""
    import torch.distributed as dist

    for c in range(start, stop, _CHUNK_BYTES):
        local = qg.local[c : min(c + _CHUNK_BYTES, stop)]  # this rank's bytes at rank r's place
        if rank == 0 and r == 0:
            out(local)
        elif rank == 0:
            if id(qg) not in bufs:
                bufs[id(qg)] = torch.empty(
                    min(_CHUNK_BYTES, qg.layout.segment_bytes), dtype=torch.uint8, device=qg.device
                )
            buf = bufs[id(qg)][: local.numel()]
            dist.recv(buf, group=qg.process_group, group_src=r)
            out(buf)
        elif rank == r:
            dist.send(local, group=qg.process_group, group_dst=0)


def _span(runs: list[tuple[int, int]], lo: int, hi: int) -> tuple[int, int]:
    """The smallest range within ``[lo, hi)`` holding every element of ``runs`` there (empty: ``(lo, lo)``)."""
    inside = [(max(a, lo), min(b, hi)) for a, b in runs if a < hi and b > lo]
    return (inside[0][0], inside[-1][1]) if inside else (lo, lo)


class _Runs:
    """Writes the gathered elements that lie in ``runs`` (one per parameter, in gathered order). A
    parameter stored in another order than row-major (a master in packed tile order,
    [Note: packed tile order in the engine]) is collected whole and written row-major once its run
    is complete: rank 0 holds one such parameter beyond its chunk."""

    def __init__(self, runs: list[tuple[int, int]], params: list[ShardedParam]) -> None:
        self.runs, self.params = runs, params
        self.pending: dict[int, torch.Tensor] = {}  # run index -> its layout tensor so far
        self.filled: dict[int, int] = {}

    def write(self, f: Any, values: torch.Tensor, start: int) -> None:
        """Write the elements of ``values`` (gathered elements ``[start, start + len)``) in ``runs``."""
        end = start + values.numel()
        for i, ((a, b), sp) in enumerate(zip(self.runs, self.params, strict=True)):
            if not (a < end and b > start):
                continue
            lo, hi = max(a, start), min(b, end)
            part = values[lo - start : hi - start]
            if sp.order is None:
                _write_bytes(f, part)
                continue
            stored = self.pending.setdefault(i, values.new_empty(b - a))
            stored[lo - a : hi - a].copy_(part)
            self.filled[i] = self.filled.get(i, 0) + (hi - lo)
            if self.filled[i] == b - a:
                _write_bytes(f, sp.full_of_stored(self.pending.pop(i)))


def _unique(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors outside any group, a tensor shared by several names once, as contiguous CPU copies."""
    out, seen = {}, set()
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key not in seen:
            seen.add(key)
            out[name] = t.detach().cpu().contiguous()
    return out
