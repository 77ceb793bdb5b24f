"""Atomic checkpoint directories, and the record of what a checkpoint holds (``blockshard.json``).

[Note: atomic checkpoints]
``blockshard.save_checkpoint(model, "ckpt/step-100")`` never writes into ``ckpt/step-100`` itself:

1. rank 0 removes what a killed save left in the sibling ``ckpt/.step-100.partial``; barrier;
2. every rank writes its boxes there with ``dcp.save`` (DCP's coordinator writes ``.metadata``
   once every rank has written its data; files are fsynced);
3. barrier (every rank finished); rank 0 writes ``blockshard.json`` (world size, the groups with
   their layouts and semantics, the blockshard and torch versions, ``"complete": true``) into it,
   then moves the previous ``ckpt/step-100`` aside (``ckpt/.step-100.old``), renames the partial
   directory to ``ckpt/step-100`` and removes the old one; barrier.

A save killed at any point before step 3's renames leaves ``ckpt/step-100`` as it was (the
previous checkpoint loads); killed between the two renames, ``ckpt/step-100`` is missing and
``load_checkpoint`` loads ``ckpt/.step-100.old`` (which is complete). A checkpoint is complete
only when its record is there, so a ``.partial`` directory is never taken for one, even after
DCP wrote its ``.metadata``. Checkpoints written by plain ``dcp.save`` have no record and load as
before (their completeness is what their ``.metadata`` and shard files say).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
from torch import nn

__all__ = ["RECORD", "finish_save", "model_record", "read_record", "resolve", "start_save"]

RECORD = "blockshard.json"
RECORD_FORMAT = 1


def _sibling(path: str, suffix: str) -> str:
    head, tail = os.path.split(os.path.normpath(path))
    return os.path.join(head, f".{tail}.{suffix}")


def is_partial(path: str) -> bool:
    tail = os.path.basename(os.path.normpath(path))
    return tail.startswith(".") and tail.endswith((".partial", ".old"))


def _process_group(model: nn.Module) -> Any:
    """The default group, as DCP's (its coordinator is global rank 0): with replicas (HSDP) a
    group's own process group has a rank 0 in every replica."""
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_initialized() else None


def _barrier(pg: Any) -> None:
    if pg is not None:
        import torch.distributed as dist

        dist.barrier(group=pg)


def _rank(pg: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(pg) if pg is not None else 0


def start_save(model: nn.Module, path: str) -> str:
    """Step 1 of [Note: atomic checkpoints]; returns the partial directory to ``dcp.save`` into."""
    pg = _process_group(model)
    partial = _sibling(path, "partial")
    if _rank(pg) == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(os.path.dirname(partial) or ".", exist_ok=True)
    _barrier(pg)
    return partial


def finish_save(model: nn.Module, path: str, partial: str, record: dict) -> None:
    """Step 3 of [Note: atomic checkpoints] (collective)."""
    pg = _process_group(model)
    _barrier(pg)
    if _rank(pg) == 0:
        tmp = os.path.join(partial, f".{RECORD}.tmp")
        with open(tmp, "w") as f:
            json.dump(record | {"complete": True}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(partial, RECORD))
        old = _sibling(path, "old")
        if not os.path.exists(path) and os.path.isfile(os.path.join(old, RECORD)):
            os.rename(old, path)  # an earlier save was killed between its renames: put it back first
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(pg)


def resolve(path: str) -> str:
    """``path``, or the previous checkpoint a save killed between its renames moved aside."""
    old = _sibling(path, "old")
    if not os.path.isdir(path) and os.path.isfile(os.path.join(old, RECORD)):
        return old
    return path


def read_record(path: str) -> dict | None:
    file = os.path.join(path, RECORD)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f)


def model_record(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict:
    """What ``blockshard.json`` records: world size, groups (layouts, semantics, every rank's
    pieces), quantized groups (formats, units, every rank's units and pieces of every entry),
    optimizers, versions. The same on every rank (layouts are checked equal)."""
    import torch.distributed as dist

    import blockshard
    from blockshard.runtime._api import _join, _states_under

    groups = []
    for prefix, st in _states_under(model):
        layout = st.group.layout
        if layout is None:
            continue
        pieces: dict[int, list] = {i: [] for i in range(len(layout.tensors))}
        for rank in range(layout.world_size):
            for p in layout.pieces(rank):
                if p.numel:
                    pieces[p.index].append([rank, p.start, p.numel])
        groups.append(
            {
                "module": prefix,
                # (BlockShard<cls>, ShardedModule, cls); a list group's classes joined by "+"
                "class": "+".join(type(m).__mro__[2].__name__ for m in st.modules),
                "world_size": layout.world_size,
                "dtype": layout.dtype,
                "segment_numel": layout.segment_numel,
                "buckets": list(layout.buckets),
                "layout_hash": layout.layout_hash(),
                "tensors": [
                    {"name": _join(prefix, t.name), "shape": list(t.shape), "semantics": t.semantics}
                    | {"pieces": pieces[i]}
                    for i, t in enumerate(layout.tensors)
                ],
            }
        )
    return {
        "format": RECORD_FORMAT,
        "saved_by": "blockshard.save_checkpoint",
        "blockshard_version": blockshard.__version__,
        "torch_version": torch.__version__,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "groups": groups,
        "quantized_groups": [
            _quantized_record(prefix, st) for prefix, st in _states_under(model) if st.group.quantized is not None
        ],
        "optimizers": [f"{type(o).__module__}.{type(o).__qualname__}" for o in optimizers],
    }


def _quantized_record(prefix: str, st: Any) -> dict:
    """A quantized group's layout ([Note: quantized layout]): segment, every tensor's format, unit
    grid, streams, every rank's units, and every state-dict entry that holds a stream with every
    rank's piece of it (elements of the entry's dtype, as DCP saved them)."""
    from blockshard.runtime._api import _join
    from blockshard.runtime._quantized_state import _module_names, _prefixes

    qg, names = st.group.quantized, _module_names(st.module)
    tensors = []
    for i, t in enumerate(qg.tensors):
        held = [(r, p) for r, ps in enumerate(qg.layout.pieces) for p in ps if p.tensor == i]
        entries = {}
        for q in _prefixes(t, names, _join(prefix, "")):
            for e in t.entries:
                if e.stream is not None:
                    size = e.dtype.itemsize
                    ranges = [(r, p.ranges[e.stream]) for r, p in held]
                    entries[q + e.name] = [[r, lo // size, (hi - lo) // size] for r, (lo, hi, _) in ranges if hi > lo]
        tensors.append(
            {
                "name": _join(prefix, t.fqn),
                "format": t.format,
                "numel": t.numel,
                "units": t.n_units,
                "streams": [{"name": s.name, "bytes": s.nbytes, "unit_bytes": s.unit_bytes} for s in t.streams],
                "pieces": [[r, p.unit_start, p.unit_stop - p.unit_start] for r, p in held],  # in units
                "entries": entries,
            }
        )
    return {
        "module": prefix,
        "class": "+".join(type(m).__mro__[2].__name__ for m in st.modules),
        "world_size": qg.world_size,
        "segment_bytes": qg.layout.segment_bytes,
        "total_bytes": qg.layout.total_bytes,
        "layout_hash": qg.layout.layout_hash(),
        "tensors": tensors,
    }
