"""What makes a checkpoint the one it claims to be: a checksum per file, a content id, and the
check that every rank of a load resolved the same checkpoint.

[Note: checkpoint integrity]
safetensors and DCP carry no checksum: 16 flipped bytes in a shard file load silently (measured:
a weight of 1.7e17). So ``save_checkpoint`` records every file of the checkpoint in its
``blockshard.json``: its bytes and its CRC-32, each rank hashing the shard files it wrote
(``__<rank>_<n>.distcp``) right after writing them, rank 0 the rest (``.metadata``), gathered in
the one collective that ends the writes. The record also carries a ``checkpoint_id`` (random,
fresh per save): the content id of the checkpoint.

``load_checkpoint`` (``verify=True``, the default) splits the recorded files among the ranks
(file ``i`` of the sorted list to rank ``i % W``), each rank re-hashes its share, and a file whose
size or hash differs raises :class:`CheckpointError` naming it, on every rank, before ``dcp.load``
reads a byte. The cost is one extra read of the checkpoint spread over the ranks
(``benchmarks/checkpoint.py`` reports the load with and without it, docs/engine.md the numbers).
In the same collective every rank shares the content id of the checkpoint it resolved (the record's ``checkpoint_id``; for a plain ``dcp.save`` checkpoint, the checksum of
its ``.metadata``): ranks that resolved different checkpoints (each picking "latest" while a save
lands) raise on every rank instead of each loading its own.
"""

from __future__ import annotations

import os
import re
import zlib
from typing import Any

__all__ = ["content_id", "file_sums", "hash_file", "verify_share"]

_CHUNK = 8 << 20
_OWN = re.compile(r"^__(\d+)_\d+\.distcp$")


def hash_file(path: str) -> dict[str, Any]:
    """``{"bytes": size, "crc32": checksum}`` of one file (zlib's CRC-32: it catches every burst
    of up to 32 flipped bits and all but 2**-32 of other damage; 2-3x SHA-256's speed here)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"bytes": size, "crc32": crc}


def own_sums(directory: str, rank: int) -> dict[str, dict[str, Any]]:
    """The checksums of the shard files this rank wrote into ``directory``."""
    out = {}
    for name in sorted(os.listdir(directory)):
        m = _OWN.match(name)
        if m and int(m.group(1)) == rank:
            out[name] = hash_file(os.path.join(directory, name))
    return out


def file_sums(directory: str, gathered: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every file of ``directory`` with its checksum: the ranks' own (``gathered``), the rest
    hashed here (rank 0: ``.metadata``, shard files of ranks that hashed nothing)."""
    sums: dict[str, dict[str, Any]] = {}
    for part in gathered:
        sums |= part
    for name in sorted(os.listdir(directory)):
        if name not in sums and os.path.isfile(os.path.join(directory, name)) and not name.startswith(".blockshard"):
            sums[name] = hash_file(os.path.join(directory, name))
    return dict(sorted(sums.items()))


def verify_share(path: str, record: dict[str, Any] | None, rank: int, world_size: int) -> list[str]:
    """What is wrong with this rank's share of the recorded files (``[]``: nothing, or no record)."""
    files = (record or {}).get("files")
    if not isinstance(files, dict):
        return []
    problems = []
    for i, (name, want) in enumerate(sorted(files.items())):
        if i % world_size != rank:
            continue
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            problems.append(f"file {name!r} is missing")
            continue
        got = hash_file(full)
        if not isinstance(want, dict) or got["bytes"] != want.get("bytes"):
            problems.append(f"file {name!r} has {got['bytes']} bytes, the record says {want.get('bytes')}")
        elif got["crc32"] != want.get("crc32"):
            problems.append(f"file {name!r} does not match its recorded CRC-32 (its bytes changed since the save)")
    return problems


def content_id(path: str, record: dict[str, Any] | None) -> str:
    """The id of the checkpoint at ``path``: the record's ``checkpoint_id``, else the size and
    CRC-32 of its ``.metadata`` (a plain ``dcp.save`` checkpoint)."""
    if record and isinstance(record.get("checkpoint_id"), str):
        checkpoint_id: str = record["checkpoint_id"]
        return checkpoint_id
    metadata = os.path.join(path, ".metadata")
    if not os.path.isfile(metadata):
        return f"(no .metadata at {path})"
    sums = hash_file(metadata)
    return f"metadata:{sums['bytes']}:{sums['crc32']:08x}"
