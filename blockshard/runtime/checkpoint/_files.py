"""Atomic checkpoint directories, and the record of what a checkpoint holds (``blockshard.json``).

[Note: atomic checkpoints]
``blockshard.save_checkpoint(model, "ckpt/step-100")`` never writes into ``ckpt/step-100`` itself:

1. rank 0 checks the path ([Note: what a save may replace]) and removes what a killed save left in
   the sibling ``ckpt/.step-100.partial``; every rank learns the outcome (one broadcast);
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
DCP wrote its ``.metadata``. A save that raises (on every rank, as DCP's save does when a write
fails or a peer dies) removes its partial directory. Checkpoints written by plain ``dcp.save`` have no record and load as
before (their completeness is what their ``.metadata`` and shard files say).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from typing import Any, TypeGuard

import torch
from torch import nn

from blockshard._errors import CheckpointError
from blockshard._version import __version__
from blockshard.runtime.checkpoint._integrity import file_sums, own_sums
from blockshard.runtime.checkpoint._quantized_state import _module_names, _prefixes
from blockshard.runtime.core._inspect import join_name, states_under
from blockshard.runtime.core._module import unswapped_class
from blockshard.runtime.quantized._frozen import frozen_buffers

__all__ = [
    "RECORD",
    "abandon_save",
    "atomic_save",
    "base_record",
    "check_save_path",
    "failure_cause",
    "finish_save",
    "model_record",
    "raise_on_every_rank",
    "read_record",
    "resolve",
    "start_save",
]

RECORD = "blockshard.json"
RECORD_FORMAT = 2  # 2: checkpoint_id and files (checksums) added; format 1 records load as before


def _sibling(path: str, suffix: str) -> str:
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{tail}.{suffix}")


def is_partial(path: str) -> bool:
    tail = os.path.basename(os.path.normpath(path))
    return tail.startswith(".") and tail.endswith((".partial", ".old"))


def _process_group() -> Any:
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


def atomic_save(path: str, write: Callable[[str], None], record: Callable[[], dict[str, Any]]) -> None:
    """[Note: atomic checkpoints]: ``write(partial)`` (every rank: ``dcp.save`` into the partial
    directory), then ``record()`` is written and the partial directory swapped in (collective).
    Any failure raises :class:`CheckpointError` (an ``Exception``) on every rank that is still
    there, naming ``path`` and the cause; the previous checkpoint is left as it was."""
    from torch.distributed.checkpoint.api import CheckpointException

    partial = start_save(path)
    try:
        write(partial)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        abandon_save(partial)
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(
            f"save_checkpoint({path!r}) failed while writing: {failure_cause(e)}. Nothing was swapped in: the "
            "previous checkpoint at that path, if any, is unchanged. Fix: free space, fix permissions, or restart "
            "the ranks that died, then save again"
        ) from e
    finish_save(path, partial, record())


def failure_cause(e: BaseException) -> str:
    """One line for what failed: a DCP ``CheckpointException``'s first rank's exception, or ``e``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, pair = sorted(failures.items(), key=lambda kv: kv[0])[0]
        inner = pair[0] if isinstance(pair, tuple) else pair
        more = f" (and {len(failures) - 1} more ranks)" if len(failures) > 1 else ""
        return f"on rank {rank}: {type(inner).__name__}: {inner}{more}"
    return f"{type(e).__name__}: {e}"


def start_save(path: str) -> str:
    """Step 1 of [Note: atomic checkpoints]: rank 0 checks ``path`` ([Note: what a save may
    replace]) and clears what a killed save left; every rank learns the outcome in one collective
    and raises the same :class:`CheckpointError` if it failed, before anything is written.
    Returns the partial directory to ``dcp.save`` into."""
    pg = _process_group()
    partial = _sibling(path, "partial")
    error = None
    if _rank(pg) == 0:
        try:
            check_save_path(path)
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(os.path.dirname(partial) or ".", exist_ok=True)
        except (CheckpointError, OSError) as e:
            error = str(e) if isinstance(e, CheckpointError) else _os_error(path, e)
    raise_on_every_rank(pg, error)
    return partial


def abandon_save(partial: str) -> None:
    """A save that raised (on every rank, as DCP's save does): rank 0 removes its partial
    directory, so a failed save leaves nothing behind (a killed one leaves it for the next save
    to clear). No collective: the peers may be gone."""
    if _rank(_process_group()) == 0 and not _foreign(partial):
        shutil.rmtree(partial, ignore_errors=True)


def finish_save(path: str, partial: str, record: dict[str, Any]) -> None:
    """Step 3 of [Note: atomic checkpoints] (collective): every rank's checksums of the files it
    wrote reach rank 0 ([Note: checkpoint integrity]), which writes the record and swaps; a
    failure anywhere raises on every rank."""
    import torch.distributed as dist

    pg = _process_group()
    rank = dist.get_rank() if pg is not None else 0  # DCP names shard files by global rank
    mine: tuple[dict[str, Any], str | None]
    try:
        mine = (own_sums(partial, rank), None)
    except OSError as e:
        mine = ({}, _os_error(path, e))
    gathered: list[Any] = [mine]
    if pg is not None:
        gathered = [None] * dist.get_world_size(pg)
        dist.all_gather_object(gathered, mine, group=pg)
    error = next((e for _, e in gathered if e), None)
    if _rank(pg) == 0 and error is None:
        try:
            files = file_sums(partial, [sums for sums, _ in gathered])
            _swap_in(path, partial, record | {"checkpoint_id": uuid.uuid4().hex, "files": files})
        except OSError as e:
            error = _os_error(path, e)
    if error is not None and _rank(pg) == 0:
        abandon_save(partial)
    raise_on_every_rank(pg, error)


def _swap_in(path: str, partial: str, record: dict[str, Any]) -> None:
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


def _os_error(path: str, e: OSError) -> str:
    return (
        f"save_checkpoint({path!r}) failed: {type(e).__name__}: {e}. The previous checkpoint at that path, if "
        "any, is unchanged. Fix: free space or fix the permissions there, or save to another path"
    )


def raise_on_every_rank(pg: Any, error: str | None) -> None:
    """Rank 0's (of ``pg``) outcome, shared in one collective (it replaces a barrier): every rank
    raises it as :class:`CheckpointError`."""
    if pg is not None:
        import torch.distributed as dist

        box = [error]
        dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
        error = box[0]
    if error is not None:
        raise CheckpointError(error)


# [Note: what a save may replace]
# ``save_checkpoint(model, path)`` moves ``path`` aside and removes it once the new checkpoint is in
# place, and removes the ``.partial`` / ``.old`` siblings a killed save left. So before writing,
# rank 0 checks that each of them is absent, an empty directory, or holds only the files a
# blockshard save writes (DCP's ``.metadata`` and ``__<rank>_<n>.distcp`` files, ``blockshard.json``
# and their temporaries), and ``path`` itself, if not empty, has the record of a blockshard
# checkpoint: a directory with anything else in it (``outputs/`` holding ``train.log``), a plain
# ``dcp.save`` checkpoint, a file, a symbolic link, a mount point, the file system's root, and the
# working directory or one above it raise, naming the path, and nothing is written.
_OURS = re.compile(
    r"^(blockshard\.json|\.blockshard\.json\.tmp|\.metadata(\.tmp)?|__\d+_\d+\.distcp|__\d+\.metadata(\.tmp)?)$"
)


def _foreign(path: str) -> list[str]:
    """What in directory ``path`` no blockshard save writes (empty when ``path`` does not exist)."""
    if not os.path.lexists(path):
        return []
    if os.path.islink(path) or not os.path.isdir(path):
        return [os.path.basename(path)]
    out = []
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        if not _OURS.match(entry) or os.path.islink(full) or not os.path.isfile(full):
            out.append(entry + ("/" if os.path.isdir(full) else ""))
    return out


def check_save_path(path: str) -> None:
    """Raise :class:`CheckpointError` unless ``save_checkpoint`` may write to ``path``
    ([Note: what a save may replace]); no collective, nothing written."""
    full = os.path.abspath(path)
    parent = os.path.dirname(full)
    fix = "Fix: pass a directory of its own for the checkpoint (e.g. outputs/checkpoint-100)"
    if parent == full:
        raise CheckpointError(f"save_checkpoint({path!r}): the file system's root cannot hold a checkpoint. {fix}")
    real, cwd = os.path.realpath(full), os.path.realpath(os.getcwd())
    if os.path.commonpath([real, cwd]) == real:
        raise CheckpointError(
            f"save_checkpoint({path!r}): that is the working directory {cwd!r} or holds it; a save replaces its "
            f"whole directory. {fix}"
        )
    if os.path.lexists(full):
        if os.path.islink(full):
            raise CheckpointError(
                f"save_checkpoint({path!r}) is a symbolic link (to {os.path.realpath(full)!r}); a save would replace "
                "the link. Fix: pass the directory it points to"
            )
        if not os.path.isdir(full):
            raise CheckpointError(f"save_checkpoint({path!r}) is a file, not a checkpoint directory. {fix}")
        if os.path.ismount(full):
            raise CheckpointError(f"save_checkpoint({path!r}) is a mount point, which cannot be replaced. {fix}")
        foreign = _foreign(full)
        if foreign:
            raise CheckpointError(
                f"save_checkpoint({path!r}): that directory holds files that are not a blockshard checkpoint's "
                f"({_few(foreign)}); a save replaces the whole directory and would delete them. {fix}, or move "
                "those files away"
            )
        if os.listdir(full) and not _is_record(read_record_or_none(full)):
            raise CheckpointError(
                f"save_checkpoint({path!r}): that directory holds a checkpoint that blockshard.save_checkpoint did "
                f"not write (no {RECORD}), which a save would delete. {fix}, or remove it yourself"
            )
    for sibling in (_sibling(full, "partial"), _sibling(full, "old")):
        foreign = _foreign(sibling)
        if foreign:
            raise CheckpointError(
                f"save_checkpoint({path!r}) uses {sibling!r} for its swap, and that holds files a blockshard save "
                f"does not write ({_few(foreign)}). Fix: move {sibling!r} away"
            )
    _check_parent(path, parent)


def _check_parent(path: str, parent: str) -> None:
    """The parent must be (or become) a writable directory: the swap's siblings live there."""
    existing = parent
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise CheckpointError(
            f"save_checkpoint({path!r}): {existing!r} is a file, so no directory can be made under it. Fix: pass a "
            "path under a directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"save_checkpoint({path!r}): {existing!r} is not writable, and a save writes its new checkpoint beside "
            "the old one there. Fix: fix its permissions or save under a writable directory"
        )


def _few(items: list[str], n: int = 5) -> str:
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(repr(i) for i in items[:n]) + more


SAVERS = ("blockshard.save_checkpoint", "blockshard.integrations.accelerate")  # who writes records


def _is_record(record: Any) -> TypeGuard[dict[str, Any]]:
    return isinstance(record, dict) and record.get("saved_by") in SAVERS


def read_record_or_none(path: str) -> Any:
    """The record, or ``None`` when it is missing or unreadable (never raises)."""
    try:
        return read_record(path)
    except CheckpointError:
        return None


def resolve(path: str) -> str:
    """``path``, or the previous checkpoint a save killed between its renames moved aside."""
    old = _sibling(path, "old")
    if not os.path.isdir(path) and os.path.isfile(os.path.join(old, RECORD)):
        return old
    return path


def read_record(path: str) -> dict[str, Any] | None:
    """The checkpoint's record, ``None`` if it has none; a record that cannot be read or is not a
    blockshard record raises :class:`CheckpointError` naming the file."""
    file = os.path.join(path, RECORD)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(
            f"checkpoint {path!r}: its {RECORD} cannot be read ({type(e).__name__}: {e}). Fix: load another "
            f"checkpoint, or remove {RECORD} to load the directory as a plain DCP checkpoint"
        ) from None
    if not _is_record(data):
        what = f"a JSON {type(data).__name__}" if not isinstance(data, dict) else f"saved_by={data.get('saved_by')!r}"
        raise CheckpointError(
            f"checkpoint {path!r}: its {RECORD} is not a blockshard record ({what}; a record is an object with "
            f"saved_by one of {list(SAVERS)}). Fix: load another checkpoint, or remove {RECORD} to load the "
            "directory as a plain DCP checkpoint"
        )
    return data


def model_record(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """What ``blockshard.json`` records: world size, groups (layouts, semantics, every rank's
    pieces), frozen quantized weights (formats, units, every rank's units and pieces of every entry),
    optimizers, versions. The same on every rank (layouts are checked equal)."""

    groups = []
    for prefix, st in states_under(model):
        layout = st.buffers.layout
        if layout is None:
            continue
        pieces: dict[int, list[list[int]]] = {i: [] for i in range(len(layout.tensors))}
        tp = {sp.fqn: sp.tp for sp in st.buffers.params if sp.tp is not None}
        for rank in range(layout.world_size):
            for p in layout.pieces(rank):
                if p.numel:
                    pieces[p.index].append([rank, p.start, p.numel])
        groups.append(
            {
                "module": prefix,
                # the model's own class (unswapped_class); a list group's classes joined by "+"
                "class": "+".join(unswapped_class(type(m)).__name__ for m in st.modules),
                "world_size": layout.world_size,
                "dtype": layout.dtype,
                "segment_numel": layout.segment_numel,
                "buckets": list(layout.buckets),
                "layout_hash": layout.layout_hash(),
                "tensors": [
                    {"name": join_name(prefix, t.name), "shape": list(t.shape), "semantics": t.semantics}
                    | {"pieces": pieces[i]}
                    | _tp_record(tp.get(t.name))
                    for i, t in enumerate(layout.tensors)
                ],
            }
        )
    return base_record("blockshard.save_checkpoint", optimizers) | {
        "groups": groups,
        "quantized_groups": [
            _quantized_record(prefix, st) for prefix, st in states_under(model) if frozen_buffers(st) is not None
        ],
    }


def _tp_record(spec: Any) -> dict[str, Any]:
    """A tensor-parallel tensor's entry in the record ([Note: tensor-parallel parameters]): its
    ``shape`` and ``pieces`` are then its TP-local tensor's over dp (alike on every tp rank of an even
    split), ``tp`` says where that sits in the global tensor."""
    if spec is None:
        return {}
    return {"tp": {"placement": repr(spec.placements[0]), "degree": spec.mesh.size(), "global_shape": list(spec.shape)}}


def base_record(saved_by: str, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """What every record holds: who saved it, versions, world size, optimizer classes."""
    import torch.distributed as dist

    return {
        "format": RECORD_FORMAT,
        "saved_by": saved_by,
        "blockshard_version": __version__,
        "torch_version": torch.__version__,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "optimizers": [f"{type(o).__module__}.{type(o).__qualname__}" for o in optimizers],
    }


def _quantized_record(prefix: str, st: Any) -> dict[str, Any]:
    """The layout of a group's frozen quantized weights ([Note: quantized layout]): segment, every
    tensor's format, unit grid, sections (under the key ``streams``, as records have always named
    them), every rank's units, and every state-dict entry that holds a section with every rank's
    piece of it (elements of the entry's dtype, as DCP saved them)."""

    qg, names = frozen_buffers(st), _module_names(st.module)
    assert qg is not None
    tensors = []
    for i, t in enumerate(qg.tensors):
        held = [(r, p) for r, ps in enumerate(qg.layout.pieces) for p in ps if p.tensor == i]
        entries = {}
        for q in _prefixes(t, names, join_name(prefix, "")):
            for e in t.entries:
                if e.section is not None:
                    size = e.dtype.itemsize
                    ranges = [(r, p.ranges[e.section]) for r, p in held]
                    entries[q + e.name] = [[r, lo // size, (hi - lo) // size] for r, (lo, hi, _) in ranges if hi > lo]
        tensors.append(
            {
                "name": join_name(prefix, t.fqn),
                "format": t.format,
                "numel": t.numel,
                "units": t.n_units,
                # the sections, under the key earlier records use (a file format: not renamed)
                "streams": [
                    {"name": s.name, "bytes": s.nbytes, "unit_bytes": s.unit_bytes}
                    | ({"runs": [list(r) for r in s.runs]} if s.runs else {})
                    for s in t.sections
                ],
                # a tile-placed tensor's units are tiles in tile-major order, its entries' pieces in that order
                **({"tile_major": list(t.tiles.tile)} if t.tiles is not None else {}),
                "pieces": [[r, p.unit_start, p.unit_stop - p.unit_start] for r, p in held],  # in units
                "entries": entries,
            }
        )
    return {
        "module": prefix,
        "class": "+".join(unswapped_class(type(m)).__name__ for m in st.modules),
        "world_size": qg.world_size,
        "segment_bytes": qg.layout.segment_bytes,
        "total_bytes": qg.layout.total_bytes,
        "layout_hash": qg.layout.layout_hash(),
        "tensors": tensors,
    }
