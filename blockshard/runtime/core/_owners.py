"""The engine's owner plan: who computes each compute unit that a rank boundary cuts.

[Note: engine owner plan]
Under ``fully_shard(..., policy="owner" | "auto")`` a group may lay out some tensors on their
placement grids (``planner/_policy.py``): storage is cut at placement units and a compute unit (a
Muon matrix, an expert) may straddle rank boundaries. Every call that balances groups
([Note: cost tally] in ``_api.py``) rebuilds the owner plan of its subtree with the planner's
:class:`~blockshard.planner._compute.OwnerPlanBuilder` — the same rotations as before for groups without
owner-computed tensors, then one greedy over every cut unit of the subtree (longest first,
[Note: owners across groups]) — and checks its hash across ranks like a layout hash, so a rank with
another plan raises on every rank. The builder may re-base a group at another tensor
([Note: shifts] in ``planner/_compute.py``) or move one of its tensors elsewhere in its order
([Note: tensor moves] in ``planner/_moves.py``); a rotation by whole segments is moved by the
balancing call itself, a shift or a move here (:func:`apply_shifts`: one ``all_to_all_single`` that
sends every element to its new rank and place, before training), so the engine runs the layouts and owners that
``plan_model`` (``blockshard plan``) shows for the same model. The plan is kept on each group
(``ParamBuffers.owner_computed``); the last balancing call of a model (its root) writes the final one.
An optimizer finds it from a sharded piece (:func:`tensor_owner_plan`) or for a whole model
(:func:`owner_plan`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from blockshard.planner._compute import OwnerAssignment, OwnerPlanBuilder
from blockshard.planner._layout import GroupLayout
from blockshard.planner._owner import unit_rows
from blockshard.planner._plan import group_kind
from blockshard.runtime.core._buffers import ParamBuffers
from blockshard.runtime.core._collectives import check_same_layout
from blockshard.runtime.core._state import state_of
from blockshard.semantics import UnitGrid

__all__ = [
    "EngineOwnerPlanBuilder",
    "OwnerComputed",
    "TensorOwnerPlan",
    "TensorOwners",
    "build_owner_plan",
    "owner_plan",
    "qualified_group",
    "record_compute",
    "tensor_owner_plan",
]


@dataclass(frozen=True)
class TensorOwnerPlan:
    """The owner plan of one owner-computed tensor of a group: where it lies and which rank (its
    units' owner) computes each cut unit. ``blockshard.runtime.TensorOwners`` is its former name.

    Rank ``h`` holds elements ``piece(h)`` of the tensor's flattening (``[h * S - offset, ...)``
    clipped to the tensor). ``units``: ``(start, numel, owner)`` of every cut compute unit; compute
    units not listed lie inside one rank's piece and are computed there.
    """

    name: str
    shape: tuple[int, ...]
    compute: UnitGrid
    offset: int  # in its bucket of the gathered buffer
    segment_numel: int  # S of that bucket
    world_size: int
    units: tuple[tuple[int, int, int], ...]
    owner_hash: str

    @property
    def numel(self) -> int:
        return self.compute.numel

    def piece(self, rank: int) -> tuple[int, int]:
        """``(start, stop)`` of the elements rank ``rank`` holds."""
        n = self.numel
        lo = min(max(rank * self.segment_numel - self.offset, 0), n)
        return lo, max(lo, min(max((rank + 1) * self.segment_numel - self.offset, 0), n))


TensorOwners = TensorOwnerPlan  # its name before "owner" meant only a rank (kept: a public name)


@dataclass
class OwnerComputed:
    """The owner-computed tensors of one group and their owner plan, kept on the group itself
    (``owner_computed``): nothing outside the group holds it, nothing outlives it."""

    compute: dict[str, UnitGrid]  # owner-computed tensors of the group, by name in the group
    units: dict[str, tuple[tuple[int, int, int], ...]] = dataclasses.field(default_factory=dict)
    owner_hash: str = ""


def record_compute(group: ParamBuffers, compute: Mapping[str, UnitGrid]) -> None:
    """Note ``group``'s owner-computed tensors (their compute grids), at ``fully_shard``."""
    if compute:
        group.owner_computed = OwnerComputed(dict(compute))


def compute_of(group: ParamBuffers) -> dict[str, UnitGrid]:
    entry = group.owner_computed
    return entry.compute if entry is not None else {}


@dataclass
class EngineOwnerPlanBuilder(OwnerPlanBuilder):
    """:class:`OwnerPlanBuilder` for the engine: a group the builder re-bases at another tensor
    ([Note: shifts]) is returned unmoved from :meth:`add_group` (the balancing call rotates by whole
    segments only) and kept in ``shifted``, by its smallest tensor name, for :func:`apply_shifts`."""

    shifted: dict[str, GroupLayout] = dataclasses.field(default_factory=dict)
    _chose_shift: bool = False

    def _best_shift(
        self,
        layout: GroupLayout,
        compute: Mapping[str, UnitGrid],
        costs: Mapping[str, float],
        running: np.ndarray,
        current: tuple[np.ndarray, np.ndarray, int],
    ) -> tuple[GroupLayout, np.ndarray, np.ndarray, int]:
        best = super()._best_shift(layout, compute, costs, running, current)
        self._chose_shift = best[0] is not layout
        return best

    def add_group(self, layout: GroupLayout, *args: Any) -> GroupLayout:
        self._chose_shift = False
        out = super().add_group(layout, *args)
        if not self._chose_shift:
            return out
        self.shifted[_key(layout)] = out
        return layout

    def add_fixed(
        self,
        layout: GroupLayout,
        kind: str,
        compute: Mapping[str, UnitGrid],
        costs: Mapping[str, float],
        running: np.ndarray,
    ) -> None:
        """A group balanced by an earlier call: its own cost and cut units, not rotated again."""
        _, base, _, _ = self._geometry(layout, compute, costs)
        running += base
        self.total += self._total(layout, costs)
        self._collect(layout, compute, costs, kind)


def qualified(layout: GroupLayout, prefix: str) -> GroupLayout:
    """``layout`` with every tensor named ``prefix + name`` (names are unique across the groups)."""
    if not prefix:
        return layout
    return dataclasses.replace(
        layout, tensors=tuple(dataclasses.replace(t, name=prefix + t.name) for t in layout.tensors)
    )


def qualified_group(st: Any, prefix: str) -> tuple[GroupLayout, str, dict[str, UnitGrid], dict[str, float]]:
    """A group's state as the owner builder sees it: tensor names prefixed by its module's path."""
    layout = st.buffers.layout
    compute = {prefix + n: g for n, g in compute_of(st.buffers).items()}
    costs = {prefix + n: c for n, c in st.buffers.costs.items()}
    return qualified(layout, prefix), group_kind(prefix.rstrip(".")), compute, costs


def _key(layout: GroupLayout) -> str:
    return min(t.name for t in layout.tensors)  # qualified names are unique across a model's groups


def apply_shifts(what: str, named: Sequence[tuple[str, Any]], builder: EngineOwnerPlanBuilder) -> None:
    """Move every group ``builder`` re-based ([Note: shifts]) or re-laid ([Note: tensor moves] in
    ``planner/_moves.py``) to its new layout, before training: one ``all_to_all_single`` per group
    (:func:`moved_values`) that sends every element of each rank's segment to the rank and position
    the new layout gives it."""
    moved = []
    for prefix, st in named:
        layout = st.buffers.layout
        target = builder.shifted.pop(_key(qualified(layout, prefix)), None) if layout is not None else None
        if target is None:
            continue
        new = dataclasses.replace(
            target, tensors=tuple(dataclasses.replace(t, name=t.name[len(prefix) :]) for t in target.tensors)
        )
        assert len(layout.buckets) == 1 and new.buckets == layout.buckets, what  # one bucket, same segment
        local = st.buffers.local
        if local.device.type != "meta":
            pg = st.buffers.process_group
            local.copy_(moved_values(local, layout, new, pg.rank(), pg))
        st.buffers.relayout(new, 0)  # the values moved above; new parameter objects over them
        st.buffers.tag_views()
        moved.append(new.layout_hash())
    assert not builder.shifted, sorted(builder.shifted)  # every shifted group was among ``named``
    if moved:
        check_same_layout(f"{what} (shifted)", ",".join(moved), named[-1][1].buffers.process_group)


def move_lists(
    old: GroupLayout, new: GroupLayout, rank: int
) -> tuple[list[tuple[int, int]], list[int], list[tuple[int, int]], list[int]]:
    """Pure: ``(send pieces, send sizes, receive pieces, receive sizes)`` of ``rank`` for moving a
    one-bucket group from ``old`` to ``new`` (same tensors and segment ``S``). A piece is
    ``(local offset, numel)``; sends are ordered by destination rank, then by position there, and
    receives by source rank, then by position here, so both sides agree on the order. Holes of
    ``new`` are left to the caller (zeros)."""
    W, S = old.world_size, old.buckets[0]
    at = {t.name: t.offset for t in new.tensors}
    sends: list[tuple[int, int, int, int]] = []  # (dest, new position, local offset, numel)
    recvs: list[tuple[int, int, int]] = []  # (source, new position, numel)
    lo, hi = rank * S, (rank + 1) * S
    for t in old.tensors:
        if not t.numel:
            continue
        d = at[t.name] - t.offset  # old position x goes to x + d
        for a, b, other in ((max(t.offset, lo), min(t.end, hi), 0), (max(t.offset + d, lo), min(t.end + d, hi), 1)):
            y = a + (d if other == 0 else 0)  # new position of the piece's first element
            x = a - (0 if other == 0 else d)  # its old position
            n = b - a
            while n > 0:  # split where the other side's segment ends
                cut = min(n, S - ((y if other == 0 else x) % S))
                if other == 0:
                    sends.append((y // S, y, x - lo, cut))
                else:
                    recvs.append((x // S, y, cut))
                x, y, n = x + cut, y + cut, n - cut
    sends.sort()
    recvs.sort()
    send_sizes, recv_sizes = [0] * W, [0] * W
    for dst, _, _, n in sends:
        send_sizes[dst] += n
    for src, _, n in recvs:
        recv_sizes[src] += n
    return [(o, n) for _, _, o, n in sends], send_sizes, [(y - lo, n) for _, y, n in recvs], recv_sizes


def moved_values(local: torch.Tensor, old: GroupLayout, new: GroupLayout, rank: int, pg: Any) -> torch.Tensor:
    """This rank's segment of ``new``, from every rank's segment of ``old`` (one ``all_to_all_single``)."""
    sends, send_sizes, recvs, recv_sizes = move_lists(old, new, rank)

    def index(pieces: list[tuple[int, int]]) -> torch.Tensor:
        parts = [torch.arange(o, o + n, device=local.device) for o, n in pieces]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=local.device)

    out = local.new_empty(sum(recv_sizes))
    dist.all_to_all_single(
        out, local[index(sends)], output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=pg
    )
    result = torch.zeros_like(local)
    result[index(recvs)] = out
    return result


def build_owner_plan(
    what: str, named: Sequence[tuple[str, Any]], builder: EngineOwnerPlanBuilder, running: np.ndarray | None
) -> None:
    """Owners of every cut compute unit of ``named``'s groups (``(prefix, module state)`` pairs, the
    builder holding them all, unless ``running`` is ``None``: a leaf alone, not rotated), recorded
    on the groups and checked across ranks, after moving the groups the builder re-based
    (:func:`apply_shifts`). No-op without owner-computed tensors."""
    apply_shifts(what, named, builder)
    if not any(compute_of(st.buffers) for _, st in named):
        return
    if running is None:
        running = np.zeros(builder.world_size)
        for prefix, st in named:
            if st.buffers.layout is not None:
                builder.add_fixed(*qualified_group(st, prefix), running)
    digest = record_owners([(p, st.buffers) for p, st in named], assign_owners(builder, running))
    check_same_layout(f"{what} (owner plan)", digest, named[-1][1].buffers.process_group)


def assign_owners(builder: OwnerPlanBuilder, running: np.ndarray) -> OwnerAssignment:
    """The owner of every cut unit collected by ``builder`` (a seam for tests)."""
    return builder.finish(running)[0]


def record_owners(groups: Sequence[tuple[str, ParamBuffers]], assignment: OwnerAssignment) -> str:
    """Store ``assignment`` on the groups (``(prefix, group)`` pairs); return its hash."""
    digest = assignment.owner_hash()
    by_name: dict[str, list[tuple[int, int, int]]] = {}
    for t, s, n, o in unit_rows(assignment):
        by_name.setdefault(assignment.tensor_names[t], []).append((s, n, o))
    for prefix, group in groups:
        entry = group.owner_computed
        if entry is not None:
            entry.units = {name: tuple(by_name.get(prefix + name, ())) for name in entry.compute}
            entry.owner_hash = digest
    return digest


def tensor_owner_plan(group: ParamBuffers, fqn: str, name: str | None = None) -> TensorOwnerPlan | None:
    """The owner plan of tensor ``fqn`` of ``group``; ``None`` unless owner-computed."""
    entry = group.owner_computed
    if entry is None or fqn not in entry.compute:
        return None
    layout = group.layout
    assert layout is not None  # owner-computed tensors lie in a layout
    t = next(t for t in layout.tensors if t.name == fqn)
    return TensorOwnerPlan(
        name if name is not None else fqn,
        tuple(t.shape),
        entry.compute[fqn],
        t.offset,
        layout.buckets[t.bucket],
        layout.world_size,
        entry.units.get(fqn, ()),
        entry.owner_hash,
    )


def owner_plan(model: object) -> dict[str, TensorOwnerPlan]:
    """Every owner-computed tensor under ``model`` by its ``model.named_parameters()`` name."""

    out = {}
    for prefix, m in model.named_modules():  # type: ignore[attr-defined]
        st = state_of(m)
        if st is None:
            continue
        for fqn in compute_of(st.buffers):
            name = f"{prefix}.{fqn}" if prefix else fqn
            found = tensor_owner_plan(st.buffers, fqn, name)
            if found is not None:
                out[name] = found
    return out
