"""Streamed full-model export: Hugging Face safetensors written one group at a time.

[Note: streamed export]
``model.save_pretrained(path, state_dict=blockshard.full_state_dict(model))`` holds the whole
model on every rank (``full_state_dict`` gathers every group and keeps the full tensors).
:func:`save_pretrained` (collective) instead gathers one group at a time (the same all-gathers
of the local buffers, in the parameters' own dtype), writes that group's tensors from rank 0 as
one safetensors shard straight from the gathered buffer (no copy per tensor), and drops the
buffer before the next group: no rank holds more than its shard plus one gathered group. Tensors
outside every group (buffers, unsharded parameters) go into a last shard. Rank 0 also writes
``model.safetensors.index.json`` (the name -> shard map ``from_pretrained`` reads) and, for a
Hugging Face model, its ``config.json``. Tied parameters are written once, under their first
name (``from_pretrained`` ties the others again, as for Hugging Face's own ``save_pretrained``).
"""

from __future__ import annotations

import json
import os
import struct

import torch
from torch import nn

from blockshard.runtime._api import _join, _states_under
from blockshard.runtime._collectives import all_gather_into
from blockshard.runtime._piece_tensor import PieceTensor
from blockshard.runtime._state_dict import _names

__all__ = ["save_pretrained"]

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
INDEX = "model.safetensors.index.json"


def _write_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> int:
    """The safetensors format (an 8-byte header length, a JSON header, the raw bytes), written from
    the tensors' own memory; returns the bytes of tensor data."""
    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header | {"__metadata__": {"format": "pt"}}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return offset


def _rank(model: nn.Module) -> int:
    import torch.distributed as dist

    states = _states_under(model)
    if not dist.is_initialized() or not states:
        return 0
    return dist.get_rank(states[0][1].group.process_group)


@torch.no_grad()
def save_pretrained(model: nn.Module, save_directory: str | os.PathLike) -> None:
    """Write the full weights of a sharded model as Hugging Face safetensors shards (plus the index
    and, for a Hugging Face model, ``config.json``) from rank 0, gathering one group at a time
    (collective: call on every rank; see [Note: streamed export]). ``from_pretrained`` loads it."""
    path = os.fspath(save_directory)
    rank = _rank(model)
    groups = [(prefix, st) for prefix, st in _states_under(model) if st.group.layout is not None]
    state = model.state_dict()
    rest = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not isinstance(v, PieceTensor)}
    files = [f"model-{i + 1:05d}-of-{len(groups) + bool(rest):05d}.safetensors" for i in range(len(groups) + 1)]
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    weight_map: dict[str, str] = {}
    total, written = 0, set[int]()
    for file, (prefix, st) in zip(files, groups, strict=False):
        tensors = _gathered(prefix, st, set(state), written)
        if rank == 0:
            total += _write_safetensors(os.path.join(path, file), tensors)
            weight_map |= dict.fromkeys(tensors, file)
        del tensors  # the group's gathered buffer goes with its views
    if rank == 0 and rest:
        unique = _unique(rest)
        total += _write_safetensors(os.path.join(path, files[len(groups)]), unique)
        weight_map |= dict.fromkeys(unique, files[len(groups)])
    if rank == 0:
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(path)


def _gathered(prefix: str, st: object, names: set[str], written: set[int]) -> dict[str, torch.Tensor]:
    """The full tensors of one group by name (views of one gathered buffer), tied ones once."""
    g = st.group  # type: ignore[attr-defined]
    W, layout = g.world_size, g.layout
    full = torch.empty(W * layout.segment_numel, dtype=g.orig_dtype, device=g.device)
    for b, S_b in enumerate(layout.buckets):
        off = layout.bucket_local_offset(b)
        all_gather_into(full[W * off : W * (off + S_b)], g.local[off : off + S_b], g.process_group)
    out = {}
    for name, sp in _names(st.module, g.params):  # type: ignore[attr-defined]
        key = _join(prefix, name)
        if key in names and id(sp) not in written:
            written.add(id(sp))
            out[key] = full[sp.gathered_offset : sp.gathered_offset + sp.numel].view(sp.shape).cpu()
    return out


def _unique(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors outside any group, a tensor shared by several names once, as contiguous CPU copies."""
    out, seen = {}, set()
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key not in seen:
            seen.add(key)
            out[name] = t.detach().cpu().contiguous()
    return out
