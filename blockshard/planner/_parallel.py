"""Tensor- and expert-parallel layouts: what each rank of a (dp, tp) or (dp, ep) mesh holds, which
units a TP plan splits, and what blockshard then shards over the data-parallel axis.

[Note: TP and EP plans]
People who outgrow data parallelism compose it with tensor parallelism (torchtitan's 2-D mesh:
``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``, then ``fully_shard`` over
``dp``) and, for MoE models, expert parallelism. :func:`plan_parallel` lays such a mesh out on
paper, for the catalog's models or any tensor list, in four steps:

1. **Placements** (:func:`parallel_style`, torchtitan's plan for Llama-like and DeepSeek-like
   models, by parameter name): ``colwise`` (``q/k/v/gate/up_proj``, DeepSeek's ``q_b_proj`` /
   ``kv_b_proj``, ``lm_head``: the weight ``Shard(0)`` over ``tp``, rows are output features, a bias
   too); ``rowwise`` (``o_proj``, ``down_proj``: the weight ``Shard(1)``, the bias replicated);
   ``vocab`` (``embed_tokens``: ``Shard(0)`` over the vocabulary); ``expert`` (a stacked
   ``(E, ...)`` expert tensor: ``Shard(0)`` over ``ep``, by expert; replicated over ``tp`` when
   ``ep = 1``, as torchtitan does without expert-tensor parallelism); everything else (norms,
   routers, DeepSeek's ``*_a_proj``) replicated. A dim that the degree does not divide raises
   :class:`~blockshard.PlanError` naming the tensor, the dim and the degrees that divide it.
2. **Units split by the TP plan** (:func:`split_units`): the semantics are stated for the global
   tensor (what one process computes on). A TP cut keeps a unit whole when it falls where the
   semantics allow a cut: a whole unit (a Muon ``matrix``, a tensor below bitsandbytes' 4096
   elements) is split by any cut; ``shampoo:D`` and ``fp8_block:B`` tiles need the shard's extent in
   the cut dim to be a multiple of ``D`` / ``B``; ``mx``'s 1 x 32 blocks need it for ``Shard(1)``;
   a 1-D block semantics (8-bit state, NF4 groups) needs each ``Shard(0)`` cut at an allowed cut of
   its grid, and for ``Shard(1)`` (every row cut) its unit to divide the shard's row, and the shard
   to hold at least the grid's smallest piece (so the 8-bit / fp32 decision is the one-process one).
   An optimizer's split unit is computed by owner-compute across ``tp`` (the pieces gathered at an
   owner, the update sent back); a quantizer's split tile cannot be (its values are stored
   quantized where they live), so its ``fix`` names the TP degrees that keep it whole.
3. **Data-parallel plan**: the TP-local (and EP-local) shapes are planned by :func:`plan_model` over
   the data-parallel ranks: dense tensors over ``dp * ep`` (EP ranks see other tokens, so dense
   parameters are data-parallel over them too), expert tensors over ``dp``.
4. **Owner-compute traffic across tp**: for each optimizer unit a TP plan splits, the fp32 gradient
   pieces of the shards that do not own it go to its owner and the new values come back: ``2 * 4``
   bytes per moved element per step. A whole unit (a Muon matrix) moves ``(tp - 1) / tp`` of its
   elements; a tile stripe straddling a cut moves its smaller pieces (exact); a 1-D block grid
   counts the whole tensor (a bound). Owners are placed largest first on the least-loaded of the
   ``dp * tp * ep`` ranks; the report gives the total and the busiest rank.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from blockshard._errors import PlanError
from blockshard.planner._plan import ModelPlan, plan_model
from blockshard.semantics import BlockSemantics, SemanticsKind, SemanticsRules, TensorSpec, UnitGrid

__all__ = ["ParallelPlan", "Placement", "SplitUnit", "parallel_style", "placements", "plan_parallel", "split_units"]

_COLWISE = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj", "lm_head"})
_ROWWISE = frozenset({"o_proj", "down_proj"})
_VOCAB = frozenset({"embed_tokens"})
_FP32 = 4  # owner-compute moves fp32 gradients and masters


def parallel_style(name: str) -> str:
    """``"colwise"``, ``"rowwise"``, ``"vocab"``, ``"expert"`` or ``"replicate"`` for parameter
    ``name`` under torchtitan's TP / EP plan ([Note: TP and EP plans])."""
    module, _, param = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    if leaf == "experts":  # a stacked (E, ...) expert tensor (transformers 5.x MoE layout)
        return "expert"
    if leaf in _VOCAB:
        return "vocab"
    if leaf in _COLWISE:
        return "colwise"
    if leaf in _ROWWISE:
        return "rowwise" if param == "weight" else "replicate"
    return "replicate"


@dataclass(frozen=True)
class Placement:
    """Where a parameter lives on the mesh: sharded on ``dim`` over ``axis`` (``"tp"`` / ``"ep"``)
    in ``degree`` equal pieces, or replicated (``axis == ""``)."""

    name: str
    style: str
    axis: str
    dim: int | None
    degree: int
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]

    @property
    def label(self) -> str:
        return "Replicate()" if not self.axis else f"Shard({self.dim}) over {self.axis} = {self.degree}"


def _divisors_keeping(extent: int, edge: int) -> list[int]:
    """The degrees ``d > 1`` that divide ``extent`` with each piece a multiple of ``edge``."""
    return [d for d in range(2, extent + 1) if extent % d == 0 and (extent // d) % edge == 0][:8]


def placements(tensors: Iterable[TensorSpec], tp: int = 1, ep: int = 1) -> list[Placement]:
    """Every tensor's :class:`Placement` on a mesh with ``tp`` and ``ep`` (1: no such axis)."""
    out = []
    for spec in tensors:
        shape = tuple(spec.shape)
        style = parallel_style(spec.name)
        axis, dim, degree = "", None, 1
        if style == "expert" and ep > 1:
            axis, dim, degree = "ep", 0, ep
        elif style in ("colwise", "vocab") and tp > 1:
            axis, dim, degree = "tp", 0, tp
        elif style == "rowwise" and tp > 1 and len(shape) == 2:
            axis, dim, degree = "tp", 1, tp
        if axis and (dim is None or dim >= len(shape) or shape[dim] % degree):
            extent = shape[dim] if dim is not None and dim < len(shape) else 0
            fits = [d for d in range(2, max(extent, 1) + 1) if extent % d == 0][:8]
            raise PlanError(
                f"tensor {spec.name!r} of shape {shape} is sharded {style} (Shard({dim}) over {axis}) but its dim "
                f"{dim} ({extent}) is not divisible by {axis} = {degree}. Fix: choose {axis} among {fits} "
                "(torchtitan's plans need even shards)"
            )
        local = list(shape)
        if dim is not None:
            local[dim] //= degree
        out.append(Placement(spec.name, style, axis, dim, degree, shape, tuple(local)))
    return out


@dataclass(frozen=True)
class SplitUnit:
    """A tensor whose units (by its semantics ``label``) a TP plan cuts: ``kind`` is ``"optimizer"``
    (computed by owner-compute across tp) or ``"quantizer"`` (cannot be: ``fix`` says what keeps it
    whole); ``why`` says which unit and which cut."""

    name: str
    label: str
    placement: str
    kind: str
    numel: int
    why: str
    fix: str
    moved_numel: int = 0  # elements owner-compute moves to the units' owners (optimizers)

    def to_json(self) -> dict[str, Any]:
        return dict(
            name=self.name,
            semantics=self.label,
            placement=self.placement,
            kind=self.kind,
            numel=self.numel,
            moved_numel=self.moved_numel,
            why=self.why,
            fix=self.fix,
        )


def _rows_cols(shape: tuple[int, ...], dim: int) -> tuple[int, int]:
    """The 2-D view a semantics sees of ``shape`` (rows, cols), for a cut on ``dim``."""
    if len(shape) == 1:
        return 1, shape[0]
    return math.prod(shape[:-1]), shape[-1]


def _tile_moved(extent: int, tp: int, edge: int, across: int) -> int:
    """Elements that move to owners when ``tp`` shards of ``extent`` (along the cut dim) cut tiles of
    ``edge``: each straddled tile stripe (``edge`` x ``across``) goes to the shard holding most of it."""
    moved = 0
    total = extent * tp
    for a in range(0, total, edge):
        b = min(a + edge, total)
        pieces = [min(b, (k + 1) * extent) - max(a, k * extent) for k in range(a // extent, (b - 1) // extent + 1)]
        moved += (b - a - max(pieces)) * across
    return moved


def _split_reason(sem: BlockSemantics, p: Placement, dtype: str) -> tuple[str, str, int] | None:
    """Why ``p``'s TP cut splits a unit of ``sem`` on the global tensor, the fix, and the elements that
    owner-compute moves to the units' owners; None: it splits none."""
    shape, dim, tp = p.global_shape, p.dim, p.degree
    assert dim is not None
    extent = shape[dim] // tp
    name = getattr(sem, "spec", type(sem).__name__)
    edge = None
    if name.startswith("shampoo"):
        edge = (int(sem.dim), int(sem.dim))  # type: ignore[attr-defined]
    elif name.startswith("fp8_block"):
        edge = (int(sem.tile), int(sem.tile))  # type: ignore[attr-defined]
    elif name.startswith("mx"):
        edge = (1, int(sem.block))  # type: ignore[attr-defined]
    if edge is not None and len(shape) == 2:
        need = edge[dim]
        if extent % need == 0:
            return None
        what = {"shampoo": "Shampoo's", "fp8_block": "FP8's"}.get(name.split(":")[0], "MX's")
        return (
            f"{what} {edge[0]} x {edge[1]} tiles: each shard holds {extent} of dim {dim}, not a multiple of {need}",
            f"a tp among {_divisors_keeping(shape[dim], need)} keeps the tiles whole",
            _tile_moved(extent, tp, need, shape[1 - dim]),
        )
    whole_moved = math.prod(shape) * (tp - 1) // tp  # the owner holds one shard of it
    grid: UnitGrid = sem.grid(shape, dtype, tensor=p.name)
    if grid.is_whole:
        unit = "the whole matrix" if name == "matrix" else f"the whole tensor under {name}"
        return (
            f"{unit} is one unit and Shard({dim}) over tp = {tp} cuts it",
            "no tp > 1 keeps it whole: owner-compute across tp (optimizers), or replicate it over tp",
            whole_moved,
        )
    rows, cols = _rows_cols(shape, dim)
    if dim == 0:
        step = math.prod(shape) // tp
        bad = [k * step for k in range(1, tp) if not grid.allows_cut(k * step)]
        if not bad:
            return None
        return (
            f"its grid (units of {grid.unit_numel} elements, pieces of at least {grid.min_cut}) does not allow the "
            f"cut at element {bad[0]}",
            "a tp whose cuts fall on allowed cuts keeps it whole",
            whole_moved,  # at most: only the units around the cuts need move
        )
    local_row, local_numel = cols // tp, rows * (cols // tp)
    if local_row % grid.unit_numel == 0 and local_numel >= grid.min_cut:
        return None
    return (
        f"Shard(1) cuts every row into pieces of {local_row} elements, and its units are {grid.unit_numel} "
        f"elements (pieces of at least {grid.min_cut})",
        f"a tp among {_divisors_keeping(cols, grid.unit_numel)} keeps the units whole",
        whole_moved,  # at most
    )


def split_units(tensors: Iterable[TensorSpec], places: list[Placement], semantics: object = None) -> list[SplitUnit]:
    """The tensors whose units (by ``semantics``, stated on the global shapes) their TP placement
    cuts ([Note: TP and EP plans])."""
    rules = SemanticsRules.coerce(semantics)
    out = []
    for spec, p in zip(tensors, places, strict=True):
        if p.axis != "tp":
            continue
        for sem in rules.matching(spec):
            reason = _split_reason(sem, p, spec.dtype)
            if reason is None:
                continue
            kind = "quantizer" if sem.kind is SemanticsKind.QUANTIZER else "optimizer"
            label = getattr(sem, "spec", type(sem).__name__)
            why, fix, moved = reason
            out.append(SplitUnit(p.name, label, p.label, kind, math.prod(p.global_shape), why, fix, moved))
            break
    return out


@dataclass
class ParallelPlan:
    """:func:`plan_parallel`'s result: the mesh, every placement, the units the TP plan splits, the
    data-parallel plans of the dense (``dense``) and expert (``experts``) tensors, and the owner-compute
    traffic across tp."""

    dp: int
    tp: int
    ep: int
    semantics: str
    placements: list[Placement]
    split: list[SplitUnit]
    dense: ModelPlan | None
    experts: ModelPlan | None
    owner_bytes_total: int = 0
    owner_bytes_max_rank: int = 0
    itemsize: int = 2
    _loads: list[int] = field(default_factory=list, repr=False)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.ep

    @property
    def total_numel(self) -> int:
        return sum(math.prod(p.global_shape) for p in self.placements)

    def rank_bytes(self) -> tuple[int, float]:
        """The parameter bytes on the fullest rank and the mean over ranks (a rank holds its dp
        share of its TP / EP shard of every tensor)."""
        loads = self._loads
        return max(loads) * self.itemsize, sum(loads) * self.itemsize / len(loads)

    def padding_fraction(self) -> float:
        plans = [p for p in (self.dense, self.experts) if p is not None]
        padded = sum(p.padded_numel for p in plans)
        total = sum(p.total_numel for p in plans)
        return (padded - total) / padded if padded else 0.0

    def to_json(self) -> dict[str, Any]:
        full, mean = self.rank_bytes()
        by_axis: dict[str, int] = {}
        for p in self.placements:
            by_axis[p.axis or "replicated"] = by_axis.get(p.axis or "replicated", 0) + 1
        return {
            "mesh": {"dp": self.dp, "tp": self.tp, "ep": self.ep, "world_size": self.world_size},
            "semantics": self.semantics,
            "total_numel": self.total_numel,
            "tensors_by_axis": by_axis,
            "bytes_per_rank_max": full,
            "bytes_per_rank_mean": mean,
            "bytes_per_rank_ideal": self.total_numel * self.itemsize / self.world_size,
            "padding_fraction": self.padding_fraction(),
            "units_split_by_tp": [s.to_json() for s in self.split],
            "owner_compute_bytes_per_step_total": self.owner_bytes_total,
            "owner_compute_bytes_per_step_max_rank": self.owner_bytes_max_rank,
            "placements": [
                {"name": p.name, "placement": p.label, "local_shape": list(p.local_shape)} for p in self.placements
            ],
        }


def _check_degree(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name}={value!r}: the degree must be an integer >= 1. Fix: pass e.g. {name}=8")
    return value


def plan_parallel(
    tensors: Iterable[TensorSpec],
    world_size: int,
    *,
    tp: int = 1,
    ep: int = 1,
    semantics: object = None,
    policy: str = "auto",
    itemsize: int = 2,
) -> ParallelPlan:
    """Lay out ``tensors`` on ``world_size`` ranks as (dp, tp, ep) with ``dp = world_size / (tp * ep)``
    ([Note: TP and EP plans]): placements, units the TP plan splits, the data-parallel plans of the
    TP / EP-local shapes, owner-compute traffic across tp."""
    tp, ep = _check_degree("tp", tp), _check_degree("ep", ep)
    world_size = _check_degree("world_size", world_size)
    if world_size % (tp * ep):
        raise PlanError(
            f"world_size={world_size} is not a multiple of tp * ep = {tp * ep}: the mesh is (dp, tp, ep) with "
            f"dp = world_size / (tp * ep). Fix: choose a world size among {[tp * ep * k for k in (1, 2, 4, 8, 16)]}"
        )
    dp = world_size // (tp * ep)
    specs = list(tensors)
    places = placements(specs, tp, ep)
    if ep > 1 and not any(p.axis == "ep" for p in places):
        raise PlanError(
            f"ep={ep} but the model has no stacked expert tensor (names '*.experts.*'). Fix: pass ep=1 for a dense model"
        )
    split = split_units(specs, places, semantics)
    local = [
        TensorSpec(name=s.name, shape=p.local_shape, dtype=s.dtype, group=s.group)
        for s, p in zip(specs, places, strict=True)
    ]
    is_expert = [p.style == "expert" and ep > 1 for p in places]
    dense_specs = [s for s, e in zip(local, is_expert, strict=True) if not e]
    expert_specs = [s for s, e in zip(local, is_expert, strict=True) if e]
    dense = plan_model(dense_specs, dp * ep, semantics=semantics, policy=policy) if dense_specs else None
    experts = plan_model(expert_specs, dp, semantics=semantics, policy=policy) if expert_specs else None
    # rank (d, t, e) holds dense rank d * ep + e's loads of its TP shard, and expert rank d's of its EP shard
    dense_loads = dense.rank_loads() if dense else [0] * (dp * ep)
    expert_loads = experts.rank_loads() if experts else [0] * dp
    loads = [dense_loads[d * ep + e] + expert_loads[d] for d in range(dp) for e in range(ep) for _ in range(tp)]
    plan = ParallelPlan(dp, tp, ep, str(semantics or "elementwise"), places, split, dense, experts, itemsize=itemsize)
    plan._loads = loads
    moved = sorted((2 * _FP32 * s.moved_numel for s in split if s.kind == "optimizer"), reverse=True)
    plan.owner_bytes_total = sum(moved)
    heap = [0] * min(plan.world_size, max(len(moved), 1))
    for b in moved:  # each owner receives the others' pieces and sends the update back: largest first
        heapq.heapreplace(heap, heap[0] + b)
    plan.owner_bytes_max_rank = max(heap) if moved else 0
    return plan
