"""The size bounds on user input, in one place (the bottom layer: imports nothing from blockshard).

Each bound is far above any real model or cluster and far below what exhausts this machine or
overflows the planner's int64 arrays; a value past one raises an error naming the bound. Measured
with ``blockshard plan`` on a loaded 2-core machine:

* ``MAX_WORLD_SIZE``: llama3-8b plans in 2 s and 165 MB at W = 2**20; the planner builds per-rank
  arrays of length W per group, so W = 10**9 needed tens of GB.
* ``MAX_TENSOR_NUMEL``: 2**48 elements in one tensor (the largest real ones hold ~1e10); offsets
  of a layout (``W * S``) must stay below ``MAX_PADDED_NUMEL`` for numpy's int64.
* ``MAX_GROUP_TENSORS``: packing one group is superlinear in its tensor count (20,000 tensors of
  random shapes with ``muon``: 1.8 s; 200,000: 75 s); one ``fully_shard`` group of a real model
  holds at most a few thousand.
* ``MAX_MODEL_TENSORS``: identical layers plan in linear time (180,000 tensors: 7 s, 230 MB);
  2,000,000 tensors (a ~200 MB shapes file) plan in about a minute under a progress bar.
* ``MAX_JSON_BYTES``: the largest shapes file or config read (``json.load`` holds ~8x the file).
* ``MAX_ALIGNMENT_BYTES``: a segment alignment of at most a page (4096 bytes). Kernels and
  collectives ask for 16-512 bytes; every group pads up to ``W`` segments of the alignment, so a
  larger one is a typo that costs memory (``alignment_bytes=2**30`` allocated a GiB per rank and
  group, ``2**40`` died allocating). It bounds ``alignment_bytes`` wherever it is passed
  (``fully_shard``, the planner, ``blockshard plan --alignment-bytes``, the DeepSpeed and
  Accelerate settings) and the planner's ``alignment_numel`` (at most that many 1-byte elements).
* ``MAX_LOCAL_PROCESSES``: the processes ``blockshard accelerate-config --num-processes`` writes
  for one machine (``num_machines: 1``): a machine holds 8-16 accelerators, a CPU run one
  process per core at most; ``10**9`` was written and ``accelerate launch`` would have tried it.
"""

from __future__ import annotations

__all__ = [
    "MAX_ALIGNMENT_BYTES",
    "MAX_GROUP_TENSORS",
    "MAX_JSON_BYTES",
    "MAX_LOCAL_PROCESSES",
    "MAX_MODEL_TENSORS",
    "MAX_PADDED_NUMEL",
    "MAX_TENSOR_NUMEL",
    "MAX_WORLD_SIZE",
    "big_number",
]

MAX_WORLD_SIZE = 2**20
MAX_TENSOR_NUMEL = 2**48
MAX_PADDED_NUMEL = 2**60
MAX_GROUP_TENSORS = 100_000
MAX_MODEL_TENSORS = 2_000_000
MAX_JSON_BYTES = 512 * 2**20
MAX_ALIGNMENT_BYTES = 4096
MAX_LOCAL_PROCESSES = 1024


def big_number(n: int) -> str:
    """``n`` for a message: with thousands separators, or as a power of two when it is absurdly long."""
    return f"{n:,}" if n < 10**30 else f"about 2**{n.bit_length() - 1}"
