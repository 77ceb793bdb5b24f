"""DCP checkpoints of sharded models: save, checked load, and what a checkpoint directory holds.

``model.state_dict()`` already speaks DCP ([Note: state dict entries] in ``_piece_tensor.py``), so
``dcp.save(model.state_dict(), checkpoint_id=path)`` is a checkpoint that loads at any world size.
:func:`load_checkpoint` adds what ``dcp.load`` leaves to the caller: it compares the checkpoint's
metadata with the model first (every rank reads the ``.metadata`` file itself and compares its own
entries), then the ranks share the outcome (one ``all_gather_object``), so a checkpoint of another
model, of other shapes, incomplete or with a missing shard file raises :class:`CheckpointError` on
every rank, naming what differs, before any value is read — also where only some ranks' entries
differ (optimizer state of the parameters a rank holds), which would otherwise leave the other
ranks waiting in ``dcp.load``. (``dcp.load`` itself reports such cases as a ``CheckpointException``,
a ``BaseException``, that ``except Exception`` does not catch.)
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from blockshard._errors import CheckpointError
from blockshard.runtime.checkpoint._files import (
    RECORD,
    atomic_save,
    failure_cause,
    is_partial,
    model_record,
    read_record,
    resolve,
)
from blockshard.runtime.checkpoint._integrity import content_id, verify_share
from blockshard.runtime.checkpoint._optim_state import load_optimizer_state_dict, optimizer_state_dict
from blockshard.runtime.core._inspect import agree_on_call

__all__ = ["CheckpointError", "describe_checkpoint", "load_checkpoint", "save_checkpoint"]

_METADATA = ".metadata"  # written by DCP's coordinator once every rank has written its data
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
# optimizer state of parameters that other ranks hold: in the checkpoint, not in this rank's state
_OTHER_RANKS_STATE = re.compile(r"^optimizer(\.\d+)?\.state\.")


Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


def _optimizers(optimizer: Optimizers) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)


def _state(model: nn.Module, optimizer: Optimizers) -> dict[str, Any]:
    """``model.state_dict()``, or ``{"model": ..., "optimizer": ...}`` with an optimizer (a list of
    their state dicts for a sequence of optimizers, e.g. Muon and AdamW)."""
    if optimizer is None:
        return model.state_dict()

    states = [optimizer_state_dict(model, o) for o in _optimizers(optimizer)]
    return {
        "model": model.state_dict(),
        "optimizer": states[0] if isinstance(optimizer, torch.optim.Optimizer) else states,
    }


def _check_save_arguments(model: object, checkpoint_id: object, optimizer: object, fn: str = "save_checkpoint") -> str:
    """``checkpoint_id`` as a str, or :class:`CheckpointError` naming the argument that is not what
    :func:`save_checkpoint` (or :func:`load_checkpoint`: ``fn``) takes (every rank passes the same,
    so every rank raises)."""
    if not isinstance(model, nn.Module):
        raise CheckpointError(
            f"{fn}(model=...) got a {type(model).__name__}, not an nn.Module: pass the model sharded with "
            "blockshard.fully_shard (a state dict saves with torch.distributed.checkpoint.save(state, checkpoint_id=path))"
        )
    path = os.fspath(checkpoint_id) if isinstance(checkpoint_id, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path:
        raise CheckpointError(
            f"{fn}(checkpoint_id={checkpoint_id!r}) must be a directory path (a non-empty str or "
            "os.PathLike) of the checkpoint's own; pass e.g. 'checkpoints/step_100'"
        )
    listed = isinstance(optimizer, (list, tuple))
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    bad = [type(o).__name__ for o in items if not isinstance(o, torch.optim.Optimizer)]
    if optimizer is not None and bad:
        raise CheckpointError(
            f"{fn}(optimizer=...) got a {type(optimizer).__name__}{f' holding a {bad[0]}' if listed else ''}: "
            "it must be None, a torch.optim.Optimizer or a list of them (e.g. [muon, adamw]); pass the optimizers "
            "that step the model"
        )
    return path


def save_checkpoint(model: nn.Module, checkpoint_id: str | os.PathLike[str], optimizer: Optimizers = None) -> None:
    """Save ``model.state_dict()`` (with ``optimizer``: ``{"model": ..., "optimizer":
    blockshard.optimizer_state_dict(model, optimizer)}``) with DCP, atomically (collective: call
    on every rank). The directory appears complete, with a ``blockshard.json`` record of the world
    size, groups, layouts and semantics, only once every rank finished; a save killed midway
    leaves the previous checkpoint in place ([Note: atomic checkpoints] in ``_files.py``).

    ``checkpoint_id`` is a directory of the checkpoint's own: a save replaces it whole, so a path
    that holds anything but a blockshard checkpoint (``outputs/`` with a log in it, the working
    directory, ``/``) raises :class:`CheckpointError` on every rank before anything is written
    ([Note: what a save may replace]); a save that raises removes what it wrote."""
    import torch.distributed.checkpoint as dcp

    path = _check_save_arguments(model, checkpoint_id, optimizer)
    agree_on_call(model, "blockshard.save_checkpoint")  # [Note: collective headers]
    optimizers = _optimizers(optimizer)
    atomic_save(
        path,
        lambda partial: dcp.save(_state(model, optimizer), checkpoint_id=partial),
        lambda: model_record(model, optimizers),
    )


def load_checkpoint(
    model: nn.Module, checkpoint_id: str | os.PathLike[str], optimizer: Optimizers = None, *, verify: bool = True
) -> None:
    """Load a checkpoint of :func:`save_checkpoint` (or of ``dcp.save(model.state_dict())``) at any
    world size or semantics (collective).

    Checks the checkpoint against the model (and optimizer) first (:class:`CheckpointError` on
    every rank): its entries, that every rank resolved the same checkpoint, and with ``verify``
    (the default) every recorded file's checksum ([Note: checkpoint integrity]). Then
    ``dcp.load`` reads each rank's boxes straight into its pieces, and ``model.load_state_dict``
    finishes (buffers, non-tensor entries, a resharded group). Without ``optimizer``, a
    checkpoint saved with one loads the model alone (e.g. to fine-tune from it).
    """
    import torch.distributed.checkpoint as dcp

    path = resolve(_check_save_arguments(model, checkpoint_id, optimizer, "load_checkpoint"))
    agree_on_call(model, "blockshard.load_checkpoint")  # [Note: collective headers]
    state = _state(model, optimizer)
    alone = optimizer is None and _saved_with_optimizer(path)  # the model alone, e.g. to fine-tune from it
    check_on_every_rank(
        path, verify=verify, check=lambda: check_checkpoint(state, path, under="model." if alone else "")
    )
    _read(dcp, {"model": state} if alone else state, path)
    if optimizer is None:
        model.load_state_dict(state)
        return

    model.load_state_dict(state["model"])
    saved = [state["optimizer"]] if isinstance(optimizer, torch.optim.Optimizer) else state["optimizer"]
    for o, osd in zip(_optimizers(optimizer), saved, strict=True):
        load_optimizer_state_dict(model, o, osd)


def _read(dcp: Any, state: dict[str, Any], path: str) -> None:
    """``dcp.load``, its failures (a ``CheckpointException``, a ``BaseException``) as
    :class:`CheckpointError` naming the checkpoint."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(
            f"load_checkpoint({path!r}): reading the checkpoint failed: {failure_cause(e)}. Fix: load another "
            "checkpoint (its files may be damaged or truncated)"
        ) from e


def check_on_every_rank(path: str, *, verify: bool = True, check: Callable[[], None] | None = None) -> None:
    """``check()`` (e.g. :func:`check_checkpoint`), this rank's share of the checksums, and the
    checkpoint's content id on every rank: one ``all_gather_object`` over the default process
    group (as ``dcp.load``'s) when that spans more than one rank; any failure, or ranks that
    resolved different checkpoints, raise on every rank ([Note: checkpoint integrity])."""
    import torch.distributed as dist

    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if multi else (0, 1)
    error: CheckpointError | None = None
    ident = None
    try:
        record = read_record(path)
        if check is not None:
            check()
        ident = content_id(path, record)
        problems = verify_share(path, record, rank, world) if verify else []
        if problems:
            raise CheckpointError(
                f"checkpoint {path!r} is damaged: {_few(problems)}. Fix: load another checkpoint (or pass "
                "verify=False to load it as it is)"
            )
    except CheckpointError as e:
        error = e
    if multi:
        every: list[Any] = [None] * world
        dist.all_gather_object(every, (None if error is None else str(error), ident))
        failed = [(r, e) for r, (e, _) in enumerate(every) if e]
        if error is None and failed:
            raise CheckpointError(f"{failed[0][1]} (on rank {failed[0][0]}; {len(failed)} of {world} ranks)")
        idents = {i for _, i in every}
        if error is None and len(idents) > 1:
            raise CheckpointError(_mixed_message(path, [i for _, i in every]))
    if error is not None:
        raise error


def _mixed_message(path: str, idents: list[Any]) -> str:
    by: dict[Any, list[int]] = {}
    for r, i in enumerate(idents):
        by.setdefault(i, []).append(r)
    parts = "; ".join(f"ranks {ranks} checkpoint {i}" for i, ranks in by.items())
    return (
        f"load_checkpoint: the ranks resolved different checkpoints ({parts}; this rank: {path!r}), and each would "
        "load its own. Fix: resolve the path once (e.g. on rank 0) and broadcast it, or load a fixed path"
    )


def _flatten(state: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts and lists flattened with DCP's dotted names (``optimizer.state.w.exp_avg``)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= _flatten(value, f"{name}.")
        elif isinstance(value, list) and any(isinstance(v, (Mapping, list, torch.Tensor)) for v in value):
            out |= _flatten({str(i): v for i, v in enumerate(value)}, f"{name}.")
        else:
            out[name] = value
    return out


def _read_metadata(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} is not a directory. Fix: pass the directory dcp.save wrote")
    if not os.path.isfile(os.path.join(path, _METADATA)):
        raise CheckpointError(
            f"checkpoint {path!r} has no {_METADATA} file: the save did not finish on every rank (DCP writes "
            "it last), or this is not a DCP checkpoint. Fix: load the previous complete checkpoint"
        )

    if is_partial(path) and read_record(path) is None:
        raise CheckpointError(
            f"checkpoint {path!r} is what a blockshard.save_checkpoint that did not finish on every rank left (no "
            f"{RECORD}). Fix: load the checkpoint it was to replace (the same name without the dot and suffix)"
        )
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as e:  # a truncated or foreign file
        raise CheckpointError(
            f"checkpoint {path!r}: its {_METADATA} file cannot be read ({type(e).__name__}: {e}). Fix: load "
            "another checkpoint"
        ) from e


def _problems(path: str, md: Any) -> list[str]:
    """What makes a checkpoint incomplete: uncovered tensors, missing or short shard files."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = []
    for name, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            covered, numel = sum(math.prod(c.sizes) for c in entry.chunks), math.prod(entry.size)
            if covered != numel:
                out.append(f"tensor {name!r}: its chunks cover {covered} of {numel} elements")
    sizes: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    for rel, need in sorted(sizes.items()):
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            out.append(f"shard file {rel!r} is missing")
        elif os.path.getsize(full) < need:
            out.append(f"shard file {rel!r} has {os.path.getsize(full)} bytes, the metadata needs {need}")
    return out


def _saved_with_optimizer(path: str) -> bool:
    """Whether the checkpoint is ``{"model": ..., "optimizer": ...}`` (not a bare model state dict)."""
    names = _read_metadata(path).state_dict_metadata
    return (
        bool(names)
        and all(k.startswith(("model.", "optimizer.")) for k in names)
        and any(k.startswith("optimizer.") for k in names)
    )


def check_checkpoint(state: Mapping[str, object], checkpoint_id: str | os.PathLike[str], *, under: str = "") -> None:
    """Raise :class:`CheckpointError` unless the checkpoint is complete and holds every entry of
    ``state`` with the same global shape (no collective: each rank reads the metadata itself);
    ``under``: compare ``state`` with the checkpoint's entries under this prefix only."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.fspath(checkpoint_id)
    md = _read_metadata(path)
    saved = {k.removeprefix(under): v for k, v in md.state_dict_metadata.items() if k.startswith(under)}
    state = _flatten(state)
    missing = sorted(repr(k) for k in state if k not in saved)
    unexpected = sorted(repr(k) for k in saved if k not in state and not _OTHER_RANKS_STATE.match(k))
    shapes, dtypes = [], []
    for k, v in state.items():
        entry = saved.get(k)
        if isinstance(v, torch.Tensor) and isinstance(entry, TensorStorageMetadata):
            if tuple(entry.size) != tuple(v.shape):
                shapes.append(f"{k!r}: saved {tuple(entry.size)}, model {tuple(v.shape)}")
            elif entry.properties.dtype != v.dtype:
                dtypes.append(f"{k!r}: saved {entry.properties.dtype}, model {v.dtype}")
    if missing or unexpected or shapes or dtypes:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_few(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the model: {_few(unexpected)}")
        if shapes:
            parts.append(f"shapes differ: {_few(shapes)}")
        if dtypes:
            parts.append(f"dtypes differ (e.g. 8-bit state saved, 32-bit state here): {_few(dtypes)}")
        raise CheckpointError(
            f"checkpoint {path!r} does not fit this model ({'; '.join(parts)}): it was saved from another model "
            "or another configuration. Fix: load it into the model it was saved from"
        )
    problems = _problems(path, md)
    if problems:
        raise CheckpointError(f"checkpoint {path!r} is incomplete: {_few(problems)}. Fix: save it again")


def _few(items: list[str], n: int = 5) -> str:
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def describe_checkpoint(checkpoint_id: str | os.PathLike[str]) -> dict[str, Any]:
    """What a DCP checkpoint directory holds (no process group needed): the ranks that wrote
    data, every tensor's global shape, dtype, bytes and number of chunks, completeness, and for a
    checkpoint of :func:`save_checkpoint` its record: world size, groups with their layouts and
    semantics, frozen quantized weights with theirs, optimizers, versions (``None`` for plain
    ``dcp.save`` checkpoints)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.fspath(checkpoint_id)
    md = _read_metadata(path)
    ranks = sorted({int(m.group(1)) for f in os.listdir(path) if (m := _RANK_FILE.match(f))})
    tensors, objects = [], []
    for name, entry in sorted(md.state_dict_metadata.items()):
        if isinstance(entry, TensorStorageMetadata):
            dtype = entry.properties.dtype
            numel = math.prod(entry.size)
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            tensors.append(
                {"name": name, "shape": list(entry.size), "dtype": str(dtype).removeprefix("torch."), "bytes": nbytes}
                | {"chunks": len(entry.chunks)}
            )
        else:
            objects.append(name)
    problems = _problems(path, md)
    record = read_record(path)
    return {
        "path": path,
        "ranks_that_wrote": len(ranks),
        "world_size": record.get("world_size") if record else None,
        "saved_by": record.get("saved_by") if record else "dcp.save (no blockshard record)",
        "blockshard_version": record.get("blockshard_version") if record else None,
        "checkpoint_id": record.get("checkpoint_id") if record else None,
        "checksummed_files": len(record.get("files") or {}) if record else 0,
        "tensors": tensors,
        "objects": objects,
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "file_bytes": sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)),
        "complete": not problems,
        "problems": problems,
        "groups": _group_summaries(record),
        "quantized_groups": (record or {}).get("quantized_groups", []),  # [Note: quantized layout]
        "optimizers": record.get("optimizers", []) if record else [],
    }


def _group_summaries(record: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Per group of the record: module, world size, layout (buckets, segment, hash), the semantics
    of its tensors (``{semantics: count}``) and each tensor's pieces."""
    out = []
    for g in (record or {}).get("groups", []):
        semantics: dict[str, int] = {}
        try:
            for t in g["tensors"]:
                semantics[t["semantics"]] = semantics.get(t["semantics"], 0) + 1
            keys = ("module", "class", "world_size", "dtype", "segment_numel", "buckets", "layout_hash")
            out.append({k: g[k] for k in keys} | {"semantics": semantics, "tensors": g["tensors"]})
        except (KeyError, TypeError) as e:
            raise CheckpointError(
                f"the checkpoint's {RECORD} holds a malformed group ({type(e).__name__}: {e}). Fix: inspect another "
                "checkpoint; the DCP data may still load with load_checkpoint"
            ) from None
    return out
