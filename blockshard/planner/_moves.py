"""Tensor moves: a one-bucket layout with one whole-placed tensor moved elsewhere in its order.

[Note: tensor moves]
Rotations and shifts (``_balance.py``, [Note: shifts] in ``_compute.py``) keep the circular
order of a group's tensors, so two costly whole-placed units next to each other (a Shampoo
layer's two norms) always land on one rank, and a unit that nearly fills a segment (a Muon
``q_proj``) has few positions where no boundary cuts it. A *move* takes a block -- a tensor and
the hole after it, if any -- out of the order and puts it back before another block; every offset
is the sum of the blocks before it, so offsets stay aligned, holes stay between tensors and the
segment size and padding are unchanged. A move is kept when every rank boundary still falls on an
allowed cut of every tensor's grid, and its layout is then also tried with its tensor shifts. The
owner builder moves only whole-placed tensors costlier than ``SHIFT_WORTH`` x the group's mean cost
per rank (the ones that set a rank's fixed cost), at most ``MAX_MOVES`` positions each (evenly
spaced), and compares moves only where its rotations and shifts would leave a fixed cost above the
mean cost per rank so far (``OwnerPlanBuilder._best_shift`` in ``_compute.py``). The result depends only on the layout: every rank
builds the same candidates, and the engine moves a group's values once, before training
(``apply_moves`` in ``runtime/core/_owners.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from blockshard.planner._layout import GroupLayout, TensorPlacement

__all__ = ["MAX_MOVES", "tensor_moves"]

#: At most this many insertion points are tried per moved tensor.
MAX_MOVES = 16


def tensor_moves(
    layout: GroupLayout, movable: Sequence[bool], valid: Callable[[TensorPlacement, int, int], bool]
) -> list[tuple[int, ...]]:
    """Offsets, per tensor of ``layout``, of every layout with one tensor (``movable[i]``) moved
    before another block. ``valid(tensor, offset, S)``: whether a tensor may start at ``offset``."""
    if len(layout.buckets) != 1 or layout.world_size == 1 or not any(movable):
        return []
    ts = layout.tensors
    if any(not t.numel for t in ts) or ts[0].offset != 0:
        return []
    S = layout.buckets[0]
    ends = [t.offset for t in ts[1:]] + [layout.world_size * S]
    blocks = [e - t.offset for t, e in zip(ts, ends, strict=True)]
    found, seen = [], {tuple(range(len(ts)))}
    for j in range(len(ts)):
        if not movable[j]:
            continue
        rest = [i for i in range(len(ts)) if i != j]
        places = [p for p in range(len(rest) + 1) if p != j]
        if len(places) > MAX_MOVES:
            places = [places[int(i)] for i in np.linspace(0, len(places) - 1, MAX_MOVES)]
        for p in places:
            order = tuple(rest[:p] + [j] + rest[p:])
            if order in seen:
                continue
            seen.add(order)
            offs = [0] * len(ts)
            at = 0
            for i in order:
                offs[i] = at
                at += blocks[i]
            if all(valid(t, o, S) for t, o in zip(ts, offs, strict=True)):
                found.append(tuple(offs))
    return found
