"""Block-aware placements for stock FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 shards each parameter on its own with ``torch.chunk`` on a dim (``Shard(0)`` by default):
with ``c = ceil(rows / W)``, rank ``r`` holds rows ``[r*c, min((r+1)*c, rows))`` -- the last
ranks may hold fewer rows or none. A rank boundary of ``Shard(0)`` therefore falls at element
``j * c * row_numel`` of the row-major flattening (``j = 1 .. chunks-1``).

For each parameter, :func:`place` picks, in this order:

1. ``Shard(0)`` when every such boundary is an allowed cut of the parameter's unit grid
   (:meth:`UnitGrid.allows_cut`): the local shards hold whole units and any optimizer or
   quantizer computes on them exactly as on one process (**aligned**).
2. ``Shard(d)`` for another dim ``d`` when FSDP2 can shard it (``shape[d] % W == 0``: FSDP2
   requires even sharding off dim 0) and every offset where the dim-``d`` chunk changes is an
   allowed cut, so each local tensor is a concatenation of whole units in their global order.
   For grids of contiguous units this practically never helps: the dim-``d`` cuts include every
   row boundary (when ``rows > 1``), so they are allowed only if ``Shard(0)``'s are.
3. ``Shard(0)`` with **owner-compute** when the units are whole tensors (``matrix`` for Muon) or
   plain stripes of whole rows, and no quantization block is split: FSDP2 keeps its
   element-wise shards and :class:`~blockshard.integrations.fsdp2.OwnerComputeOptimizer` moves the
   pieces of each split unit to one owner, which runs the optimizer on the whole unit.
4. Otherwise :class:`FSDP2PlacementError` names the parameter, its shape, the semantics, ``W`` and
   the boundary that splits a unit, and suggests ``blockshard.fully_shard`` (the ragged engine).
   That is the case for a quantization block that ``Shard(0)`` would split (the stored shard
   itself must hold whole blocks) and for optimizer blocks an owner cannot reassemble into what the
   optimizer sees on one process (bitsandbytes' 256-element blocks with their 4096-element
   minimum: the pieces left on a rank would be stepped with fp32 state).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast, overload

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from blockshard._errors import BlockshardError
from blockshard.planner._units import ceil_div, check_world_size, rows_cols
from blockshard.runtime._report import PlacementNote, tag_placement
from blockshard.semantics import ResolvedSemantics, SemanticsKind, SemanticsRules, TensorSpec, UnitGrid, normalize_dtype

from ._traffic import count_collectives

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

__all__ = [
    "FSDP2PlacementError",
    "ParamPlacement",
    "block_placement_fn",
    "decide",
    "dim_split_keeps_units",
    "fully_shard",
    "owner_computable",
    "place",
    "placements",
    "plan_placements",
    "shard0_boundaries",
]

_ATTR = "_blockshard_fsdp2_placements"


class FSDP2PlacementError(BlockshardError):
    """Stock FSDP2 cannot shard a parameter without splitting one of its units."""


@dataclass(frozen=True)
class ParamPlacement:
    """How the adapter shards one parameter under stock FSDP2.

    ``dim``: the ``Shard(dim)`` FSDP2 uses. ``owner_compute``: ``Shard(0)`` splits some of the
    parameter's units, which :class:`OwnerComputeOptimizer` reassembles on owners.
    """

    name: str
    shape: tuple[int, ...]
    semantics: str
    world_size: int
    dim: int
    owner_compute: bool
    reason: str

    @property
    def placement(self) -> Shard:
        return Shard(self.dim)


# -- geometry ----------------------------------------------------------------------------------
def shard0_boundaries(shape: tuple[int, ...], world_size: int) -> list[int]:
    """Element offsets (row-major) of the rank boundaries of FSDP2's ``Shard(0)`` (torch.chunk)."""
    rows, row_numel = rows_cols(shape)
    if rows == 0 or row_numel == 0:
        return []
    c = ceil_div(rows, world_size)
    return [j * c * row_numel for j in range(1, ceil_div(rows, c))]


def dim_split_keeps_units(grid: UnitGrid, shape: tuple[int, ...], dim: int, world_size: int) -> bool:
    """Whether FSDP2's even ``Shard(dim)`` (``dim > 0``) cuts the flattening only at allowed cuts.

    The chunk of dim ``dim`` changes at offsets ``o * S + j * c * inner`` (``inner`` = product of
    the dims after ``dim``, ``S = shape[dim] * inner``, ``c = shape[dim] / W``; ``o`` over the outer
    index, ``j`` over chunks). Every such offset is a non-negative combination of the two generators
    ``S`` (if there is more than one outer index) and ``c * inner``, so all of them are allowed iff
    both generators are multiples of the unit and the smallest and largest offsets lie in the grid's
    ``[min_cut, max_cut]`` -- an O(1) check with :meth:`UnitGrid.allows_cut` on those offsets.
    """
    if not 0 < dim < len(shape) or shape[dim] % world_size:
        return False
    numel = math.prod(shape)
    inner = math.prod(shape[dim + 1 :])
    outer = math.prod(shape[:dim])
    step_o, step_j = shape[dim] * inner, shape[dim] // world_size * inner
    gens = ([step_o] if outer > 1 else []) + ([step_j] if world_size > 1 else [])
    gens = [g for g in gens if 0 < g < numel]
    if not gens:
        return True
    last = (outer - 1) * step_o + (world_size - 1) * step_j
    return all(grid.allows_cut(x) for x in (*gens, last))


def owner_computable(
    res: ResolvedSemantics, shape: tuple[int, ...], split_quantizers: Sequence[str] = ()
) -> tuple[bool, str]:
    """Whether an owner can reassemble the units ``Shard(0)`` splits (and, if not, why).

    ``split_quantizers``: names of quantizer semantics whose quantization blocks ``Shard(0)`` splits.
    """
    if split_quantizers:
        return False, (
            f"{split_quantizers[0]!r} is a storage format: each rank's stored shard must hold "
            "whole quantization blocks, which no optimizer wrapper can fix"
        )
    g = res.grid
    if g.is_whole:
        return True, ""
    _, row_numel = rows_cols(shape)
    plain = g.min_cut == g.unit_numel and g.max_cut == (g.numel - 1) // g.unit_numel * g.unit_numel
    if plain and row_numel and g.unit_numel % row_numel == 0:
        return True, ""
    return False, (
        f"its units ({g.unit_numel} elements, cuts only in [{g.min_cut}, {g.max_cut}]) are "
        "neither whole tensors nor plain stripes of whole rows, so the pieces left on a rank "
        "would not be stepped as on one process"
    )


def _first_bad(grid: UnitGrid, shape: tuple[int, ...], world_size: int) -> int | None:
    return next((b for b in shard0_boundaries(shape, world_size) if not grid.allows_cut(b)), None)


def _good_world_sizes(grid: UnitGrid, shape: tuple[int, ...], upto: int) -> list[int]:
    return [w for w in range(2, upto + 1) if _first_bad(grid, shape, w) is None]


# -- decisions ---------------------------------------------------------------------------------
def place(spec: TensorSpec, semantics: object, world_size: int) -> ParamPlacement:
    """Decide how FSDP2 shards ``spec`` on ``world_size`` ranks (see the module docstring).

    Raises :class:`FSDP2PlacementError` where FSDP2 cannot keep the units whole and owner-compute
    does not apply; :class:`~blockshard.SemanticsError` where the semantics reject the shape.
    """
    return decide(spec, SemanticsRules.coerce(semantics).resolve(spec), world_size)


def decide(spec: TensorSpec, res: ResolvedSemantics, world_size: int, *, other_dims: bool = True) -> ParamPlacement:
    """:func:`place` for already resolved semantics; ``other_dims=False`` considers ``Shard(0)`` only."""
    w = check_world_size(world_size)
    shape, label = spec.shape, res.label

    def decision(dim: int, owner: bool, reason: str) -> ParamPlacement:
        return ParamPlacement(spec.name, shape, label, w, dim, owner, reason)

    bad = _first_bad(res.grid, shape, w)
    if bad is None:
        return decision(0, False, "Shard(0) boundaries fall on unit boundaries")
    for d in range(1, len(shape) if other_dims else 1):
        if dim_split_keeps_units(res.grid, shape, d, w):
            return decision(d, False, f"Shard({d}) keeps units whole; Shard(0) would cut at element {bad}")
    split_q = [
        s.spec
        for s in res.semantics
        if s.kind is SemanticsKind.QUANTIZER
        and _first_bad(s.grid(shape, spec.dtype, tensor=spec.name), shape, w) is not None
    ]
    ok, why = owner_computable(res, shape, split_q)
    if ok:
        return decision(0, True, f"Shard(0) cuts a unit at element {bad}; its owner computes the whole unit")
    _, row_numel = rows_cols(shape)
    row, col = divmod(bad, row_numel)
    good = _good_world_sizes(res.grid, shape, max(8, 2 * w))
    g = res.grid
    unit = (
        "the whole tensor is one unit"
        if g.is_whole
        else f"cuts are allowed at multiples of {g.unit_numel} elements in [{g.min_cut}, {g.max_cut}]"
    )
    raise FSDP2PlacementError(
        f"parameter {spec.name!r} of shape {tuple(shape)} with semantics {label!r} cannot be sharded by "
        f"stock FSDP2 at W={w} without splitting a unit: torch.chunk puts a rank boundary at row {row} "
        f"(element {bad} of the flattening{f', column {col}' if col else ''}), which is not an allowed "
        f"cut ({unit}); no other Shard(dim) keeps units whole, and owner-compute does not apply: {why}. "
        "Fix: shard this model with blockshard.fully_shard (the ragged engine, which gives each rank "
        "whole units)"
        + (f", or use a world size whose chunk boundaries align (W in {good} do)" if good else "")
        + ", or give this parameter other semantics (e.g. an 'elementwise' rule)"
    )


def plan_placements(specs: Iterable[TensorSpec], semantics: object, world_size: int) -> dict[str, ParamPlacement]:
    """:func:`place` for every spec (pure: no process group), by name; raises on the first bad one."""
    rules = SemanticsRules.coerce(semantics)
    return {s.name: place(s, rules, world_size) for s in specs}


# -- torch glue --------------------------------------------------------------------------------
def param_specs(root: nn.Module) -> dict[int, TensorSpec]:
    """``TensorSpec`` of every parameter of ``root`` by ``id(param)`` (full shape, module type)."""
    out: dict[int, TensorSpec] = {}
    for mod_name, mod in root.named_modules(remove_duplicate=False):
        for p_name, p in mod.named_parameters(recurse=False):
            if id(p) in out:
                continue
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            out[id(p)] = spec_of(name, p, type(mod).__name__)
    return out


def spec_of(name: str, p: torch.Tensor, module_type: str | None = None) -> TensorSpec:
    return TensorSpec(name=name, shape=tuple(p.shape), dtype=normalize_dtype(p.dtype), module_type=module_type)


class BlockPlacementFn:
    """The callable :func:`block_placement_fn` returns: parameter -> ``Shard(dim)``, each decision
    recorded in ``placements`` (name -> :class:`ParamPlacement`)."""

    def __init__(
        self, rules: SemanticsRules, world_size: int, specs: dict[int, TensorSpec], named: dict[int, str]
    ) -> None:
        self._rules, self._world_size, self._specs, self._named = rules, world_size, specs, named
        self.placements: dict[str, ParamPlacement] = {}
        self.notes: dict[int, PlacementNote] = {}  # by id(param): what blockshard.report shows of it

    def __call__(self, param: nn.Parameter) -> Shard:
        spec = self._specs.get(id(param))
        if spec is None:
            name = self._named.get(id(param))
            spec = spec_of(name or f"<parameter of shape {tuple(param.shape)}>", param)
        res = self._rules.resolve(spec)
        p = decide(spec, res, self._world_size)
        self.placements[p.name] = p
        self.notes[id(param)] = PlacementNote(p.semantics, res.placement.unit_numel, res.grid.unit_numel,
                                              p.owner_compute, p.reason)  # fmt: skip
        return p.placement


def block_placement_fn(
    semantics: object, world_size: int, *, names: nn.Module | Mapping[int, str] | None = None
) -> BlockPlacementFn:
    """A ``shard_placement_fn`` for ``torch.distributed.fsdp.fully_shard`` that keeps units whole.

    Args:
        semantics: rules as :meth:`SemanticsRules.coerce` accepts (``"muon"``, ``"matrix"``,
            ``{"*.mlp.*": "nf4"}``, ...).
        world_size: the FSDP2 shard group size ``W``.
        names: the root module (parameter names and module types for rules) or a mapping
            ``id(param) -> name``; without it parameters are named by shape (globs will not match).

    The returned callable maps a parameter to ``Shard(dim)`` (see :func:`place`) or raises
    :class:`FSDP2PlacementError`; its ``placements`` attribute (name -> :class:`ParamPlacement`)
    records every decision.
    """
    rules = SemanticsRules.coerce(semantics)
    named: dict[int, str] = {}
    specs: dict[int, TensorSpec] = {}
    if isinstance(names, nn.Module):
        specs = param_specs(names)
    elif isinstance(names, Mapping):
        named = dict(names)
    elif names is not None:
        raise FSDP2PlacementError(f"names={names!r} must be an nn.Module, a mapping id(param) -> name, or None")
    return BlockPlacementFn(rules, world_size, specs, named)


def _shard_world_size(mesh: DeviceMesh | None) -> int:
    import torch.distributed as dist

    if mesh is None:
        if not dist.is_initialized():
            raise FSDP2PlacementError(
                "fully_shard(mesh=None) needs an initialized default process group; "
                "call torch.distributed.init_process_group first or pass mesh="
            )
        return dist.get_world_size()
    if mesh.ndim not in (1, 2):
        raise FSDP2PlacementError(f"mesh={mesh!r} must be 1-D (FSDP) or 2-D (HSDP: replicate x shard)")
    return mesh.size(mesh.ndim - 1)


@overload
def fully_shard(
    module: nn.Module,
    *,
    semantics: object = None,
    mesh: DeviceMesh | None = None,
    root: nn.Module | None = None,
    **fsdp_kwargs: Any,
) -> FSDPModule: ...
@overload
def fully_shard(
    module: list[nn.Module],
    *,
    semantics: object = None,
    mesh: DeviceMesh | None = None,
    root: nn.Module | None = None,
    **fsdp_kwargs: Any,
) -> list[FSDPModule]: ...
def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    semantics: object = None,
    mesh: DeviceMesh | None = None,
    root: nn.Module | None = None,
    **fsdp_kwargs: Any,
) -> FSDPModule | list[FSDPModule]:
    """``torch.distributed.fsdp.fully_shard`` with a block-aware ``shard_placement_fn``.

    Same use as torch's (bottom-up, returns the module); ``semantics`` gives each parameter its
    units (see :func:`place`), ``root`` the module whose parameter names rules match (default:
    ``module`` itself). Raises :class:`FSDP2PlacementError` naming the first parameter FSDP2
    cannot shard block-aligned, before torch shards anything. The decisions are available
    through :func:`placements`. Parameters marked ``owner_compute`` need
    :class:`OwnerComputeOptimizer` to be stepped as on one process.
    """
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if "shard_placement_fn" in fsdp_kwargs:
        raise FSDP2PlacementError(
            "pass semantics= or shard_placement_fn=, not both: this fully_shard "
            "builds the shard_placement_fn from the semantics"
        )
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    for m in modules:
        if not isinstance(m, nn.Module):
            raise FSDP2PlacementError(f"module={m!r} must be a torch.nn.Module (or a list of them)")
    w = _shard_world_size(mesh)
    names = root if root is not None else (modules[0] if len(modules) == 1 else None)
    if names is None:
        names = nn.ModuleList(modules)
    fn = block_placement_fn(semantics, w, names=names)
    for m in modules:  # decide every parameter first: fail before torch shards anything
        for p in m.parameters():
            if not isinstance(p, DTensor):  # DTensors were sharded by an earlier (child) call
                fn(p)
    slots = [(sub, attr, fn.notes[id(p)]) for m in modules for sub in m.modules()
             for attr, p in sub._parameters.items() if p is not None and id(p) in fn.notes]  # fmt: skip
    out = torch_fully_shard(module, mesh=mesh, shard_placement_fn=fn, **fsdp_kwargs)
    sharded: list[DTensor] = []
    for sub, attr, note in slots:  # the DTensors FSDP2 registered in their place tell blockshard.report
        if isinstance(param := sub._parameters.get(attr), DTensor):
            tag_placement(param, note)
            sharded.append(param)
    first = out[0] if isinstance(out, list) else out  # a list shares one FSDP2 state
    top = root if root is not None else cast(nn.Module, first)
    count_collectives(first, sharded, top, w, fsdp_kwargs.get("mp_policy"))  # [Note: traffic]
    for m in modules:
        prev = getattr(m, _ATTR, {})
        setattr(m, _ATTR, {**prev, **fn.placements})
    return out


def placements(module: nn.Module) -> dict[str, ParamPlacement]:
    """The decisions :func:`fully_shard` made for ``module`` (and its submodules sharded through it)."""
    out: dict[str, ParamPlacement] = {}
    for m in module.modules():
        out.update(getattr(m, _ATTR, {}))
    return out
