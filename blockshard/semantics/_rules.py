"""Rules that give each parameter its block semantics.

A :class:`Rule` matches by name glob, module type, tensor type, the optimizer's ``param_group`` and/or
a predicate (all given criteria must hold). A callable ``(name, tensor_spec) -> semantics | None`` is
a rule too. Every matching rule applies: their grids combine to the least common unit
(:meth:`UnitGrid.combine`); two different optimizers or two different quantizers on one tensor
are a conflict and raise :class:`~blockshard.SemanticsError` naming both and the tensor.
Tensors no rule matches are ``elementwise``.

Compute and placement grids (see [Note: placement and compute units] in ``_base.py``) combine
separately, each to its least common unit; the compute grid also holds whole placement units.
Two semantics whose compute units are coarser than their placement units (``matrix``,
``shampoo``, ``rows``, ``expert``) must nest — one's compute unit made of whole units of the
other's — or they raise :class:`ComputeUnitError`: ``rows:3`` and ``rows:2`` ask for two
different calls, ``matrix`` and ``rows:16`` agree (the matrix holds whole stripes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from blockshard._errors import ComputeUnitError, SemanticsError
from blockshard.semantics._base import BlockSemantics, Companion, SemanticsKind
from blockshard.semantics._builtins import Matrix, Parts, Shampoo, straddled_boundary
from blockshard.semantics._experts import is_stacked_experts, repeat_grid
from blockshard.semantics._grid import GridError, UnitGrid
from blockshard.semantics._presets import PRESETS
from blockshard.semantics._registry import get_semantics
from blockshard.semantics._rule import CallableRule, Rule, call_user_semantics, callable_name
from blockshard.semantics._spec import TensorSpec
from blockshard.semantics._storage import QuantizedStorage

__all__ = ["ResolvedSemantics", "SemanticsRules"]


def _returned_semantics(rule: Callable[..., object], out: object, spec: TensorSpec) -> BlockSemantics:
    try:
        return get_semantics(out)  # type: ignore[arg-type]
    except SemanticsError as exc:
        raise SemanticsError(
            f"semantics callable {callable_name(rule)} returned {out!r} for parameter {spec.name!r} (shape {spec.shape}): "
            f"{exc}. Fix the callable"
        ) from None


def _grids_of(sem: BlockSemantics, spec: TensorSpec, experts: bool) -> tuple[UnitGrid, UnitGrid]:
    """``sem``'s compute and placement grids of ``spec`` (per expert on a stacked expert tensor)."""
    own_placement = type(sem).placement_grid is not BlockSemantics.placement_grid
    if experts and sem.per_expert:
        one = TensorSpec(name=spec.name, shape=spec.shape[1:], dtype=spec.dtype, module_type=spec.module_type)
        g = repeat_grid(_grid_of(sem, one, "grid"), spec.shape[0])
        return g, repeat_grid(_grid_of(sem, one, "placement_grid"), spec.shape[0]) if own_placement else g
    g = _grid_of(sem, spec, "grid")
    return g, _grid_of(sem, spec, "placement_grid") if own_placement else g


def _grid_of(sem: BlockSemantics, spec: TensorSpec, method: str = "grid") -> UnitGrid:
    """``sem``'s grid of ``spec``, checked: a custom semantics' mistake names the semantics and the tensor."""
    where = f"semantics {sem.spec!r} ({type(sem).__qualname__}) on tensor {spec.name!r} of shape {spec.shape}"
    try:
        grid = getattr(sem, method)(spec.shape, spec.dtype, tensor=spec.name)
    except GridError as exc:
        raise SemanticsError(f"{where}: {exc}") from None
    except SemanticsError:
        raise  # a semantics' own error (BlockSemantics.error) already names the tensor
    except Exception as exc:
        raise SemanticsError(f"{where}: {method}() raised {type(exc).__name__}: {exc}; fix the semantics") from exc
    if not isinstance(grid, UnitGrid) or grid.numel != spec.numel:
        got = f"a grid of {grid.numel} elements" if isinstance(grid, UnitGrid) else repr(grid)
        raise SemanticsError(
            f"{where}: {method}() returned {got}, not a UnitGrid of the tensor's {spec.numel} elements; fix its "
            f"{method}() to return UnitGrid.units(math.prod(shape), unit_numel) or UnitGrid.whole(math.prod(shape))"
        )
    return grid


def _storage_of(sem: BlockSemantics, spec: TensorSpec) -> QuantizedStorage | None:
    """``sem``'s storage of ``spec``, checked like :func:`_grid_of`."""
    where = f"semantics {sem.spec!r} ({type(sem).__qualname__}) on tensor {spec.name!r} of shape {spec.shape}"
    try:
        out = sem.storage(spec.shape, spec.dtype)
    except SemanticsError as exc:
        raise SemanticsError(f"{where}: {exc}") from None
    except Exception as exc:
        raise SemanticsError(f"{where}: storage() raised {type(exc).__name__}: {exc}; fix the semantics") from exc
    if out is not None and (not isinstance(out, QuantizedStorage) or out.numel != spec.numel):
        raise SemanticsError(
            f"{where}: storage() returned {out!r}, not None or a QuantizedStorage of the tensor's {spec.numel} "
            "values; fix its storage()"
        )
    return out


@dataclass(frozen=True)
class ResolvedSemantics:
    """The semantics a tensor ended up with: its combined grids, cost and companions.

    ``grid``: the compute units (what ``whole`` placement keeps on one rank); ``placement_grid``:
    the placement units (where ``owner`` placement may cut the storage).
    """

    semantics: tuple[BlockSemantics, ...]
    grid: UnitGrid
    cost: float
    companions: tuple[Companion, ...]
    placement_grid: UnitGrid | None = None  # None: the same as ``grid``
    storage: QuantizedStorage | None = None  # the quantizer's bytes (None: stored in its dtype)

    @property
    def placement(self) -> UnitGrid:
        return self.grid if self.placement_grid is None else self.placement_grid

    @property
    def label(self) -> str:
        return "+".join(s.spec for s in self.semantics) or "elementwise"


class SemanticsRules:
    """An ordered set of rules; :meth:`resolve` gives a tensor its :class:`ResolvedSemantics`."""

    def __init__(self, rules: Iterable[Rule | CallableRule] = ()) -> None:
        self.rules: tuple[Rule | CallableRule, ...] = tuple(rules)
        for r in self.rules:
            if not (isinstance(r, Rule) or callable(r)):
                raise SemanticsError(
                    f"rules: {r!r} is neither a blockshard.Rule nor a callable (name, tensor_spec) -> semantics"
                )

    # -- construction from what users write -----------------------------------------------------
    @classmethod
    def coerce(cls, rules: object) -> SemanticsRules:
        """Accept ``None`` (all elementwise), a semantics string (see :meth:`parse`), a ``BlockSemantics``,
        a mapping ``glob -> semantics``, a callable ``(name, tensor_spec) -> semantics | None``, a list of
        rules/callables, or a ``SemanticsRules``."""
        if rules is None:
            return cls()
        if isinstance(rules, SemanticsRules):
            return rules
        if isinstance(rules, str):
            return cls.parse(rules)
        if isinstance(rules, BlockSemantics):
            return cls([Rule(semantics=rules, blanket=True)])
        if isinstance(rules, Mapping):
            return cls([Rule(semantics=sem, name=glob) for glob, sem in rules.items()])
        if isinstance(rules, (list, tuple)):
            return cls(rules)
        if callable(rules):
            return cls([rules])
        raise SemanticsError(
            f"semantics={rules!r} is not understood; pass a semantics string ('nf4', 'muon', "
            "'*.mlp.*=nf4,bnb8bit'), a mapping glob -> semantics, a callable or a list of blockshard.Rule"
        )

    @classmethod
    def parse(cls, text: str) -> SemanticsRules:
        """Parse ``"[GLOB=]NAME[,...]"``; a bare ``NAME`` applies to every tensor it can handle.

        A preset name (``muon``, ``adamw``) expands to its rules.
        """
        rules: list[Rule | CallableRule] = []
        for item in (t.strip() for t in text.split(",")):
            if not item:
                raise SemanticsError(f"semantics={text!r} has an empty item; write e.g. 'nf4' or '*.mlp.*=nf4,bnb8bit'")
            glob, sep, sem = item.rpartition("=")
            if sep and not glob:
                raise SemanticsError(f"semantics item {item!r} has '=' but no glob before it; write GLOB=NAME")
            if not sep and sem in PRESETS:
                rules.extend(PRESETS[sem]())
            else:
                rules.append(Rule(semantics=sem, name=glob or None, blanket=not sep))
        return cls(rules)

    # -- resolution -------------------------------------------------------------------------------
    def matching(self, spec: TensorSpec) -> list[BlockSemantics]:
        found: list[BlockSemantics] = []
        for rule in self.rules:
            if isinstance(rule, Rule):
                if rule.matches(spec):
                    found.append(rule.block_semantics)
            else:
                out = call_user_semantics(rule, (spec.name, spec), spec.name, spec.shape)
                if out is not None:
                    found.append(_returned_semantics(rule, out, spec))
        unique: list[BlockSemantics] = []
        for s in found:
            if s not in unique:
                unique.append(s)
        return unique

    def resolve(self, spec: TensorSpec, matched: list[BlockSemantics] | None = None) -> ResolvedSemantics:
        """``matched``: :meth:`matching` of ``spec`` when the caller already has it."""
        sems = self.matching(spec) if matched is None else matched
        by_kind: dict[SemanticsKind, BlockSemantics] = {}
        for s in sems:
            if s.kind.exclusive and s.kind in by_kind:
                other = by_kind[s.kind]
                raise SemanticsError(
                    f"tensor {spec.name!r} of shape {spec.shape} matches two {s.kind.value} semantics, "
                    f"{other.spec!r} and {s.spec!r}: a tensor has one {s.kind.value}. Fix: narrow the "
                    "rules (name globs, module types) so only one applies to it"
                )
            by_kind.setdefault(s.kind, s)
        experts = is_stacked_experts(spec, sems)
        _check_parts(spec, sems, experts)
        grid = UnitGrid.units(spec.numel, 1)
        placements: list[UnitGrid] = []
        coarse: list[tuple[BlockSemantics, UnitGrid]] = []
        companions: list[Companion] = []
        for s in sems:
            g, p = _grids_of(s, spec, experts)
            grid = grid.combine(g)
            placements.append(p)
            if p is not g and g != p:
                _check_nested(spec, coarse, s, g)
                coarse.append((s, g))
            companions.extend(s.companions(spec.shape, spec.dtype))
        placement = grid  # every semantics' units coincide: one grid
        if coarse:
            placement = UnitGrid.units(spec.numel, 1)
            for p in placements:
                placement = placement.combine(p)
            grid = grid.combine(placement)  # a compute unit holds whole placement units
        costly = by_kind.get(SemanticsKind.OPTIMIZER)
        if costly is None:
            cost = float(spec.numel)
        elif experts and costly.per_expert:
            cost = spec.shape[0] * _cost(costly, spec.shape[1:], spec.dtype, sems)
        else:
            cost = _cost(costly, spec.shape, spec.dtype, sems)
        quantizer = by_kind.get(SemanticsKind.QUANTIZER)
        storage = _storage_of(quantizer, spec) if quantizer is not None else None
        return ResolvedSemantics(tuple(sems), grid, cost, tuple(companions), placement, storage)

    def __repr__(self) -> str:
        return f"SemanticsRules({list(self.rules)!r})"


def _cost(sem: BlockSemantics, shape: tuple[int, ...], dtype: str, sems: list[BlockSemantics]) -> float:
    """``sem``'s cost of one matrix of ``shape``: per part of a fused weight ([Note: fused parts]) for
    Muon's ``matrix`` (Newton-Schulz on each part)."""
    parts = next((s for s in sems if isinstance(s, Parts)), None)
    if parts is None or not isinstance(sem, Matrix) or len(shape) < 2:
        return sem.cost(shape, dtype)
    return sum(sem.cost((r, *shape[1:]), dtype) for r in parts.rows)


def _check_parts(spec: TensorSpec, sems: list[BlockSemantics], experts: bool) -> None:
    """Shampoo's stripes of ``D`` rows must not straddle a fused weight's parts ([Note: fused parts])."""
    parts = next((s for s in sems if isinstance(s, Parts)), None)
    shampoo = next((s for s in sems if isinstance(s, Shampoo)), None)
    if parts is None or shampoo is None:
        return
    off = straddled_boundary(parts.rows, shampoo.dim)
    if off is not None:
        raise ComputeUnitError(
            f"tensor {spec.name!r} of shape {spec.shape} is declared {parts.spec!r} (a fused weight) and gets "
            f"{shampoo.spec!r}: the part boundary at row {off}{' of each expert' if experts else ''} is not a "
            f"multiple of {shampoo.dim}, so a {shampoo.dim}-row Shampoo tile would hold rows of two parts. Fix: a "
            "max_preconditioner_dim that divides every part's rows, or unfuse the weight"
        )


def _check_nested(
    spec: TensorSpec, coarse: list[tuple[BlockSemantics, UnitGrid]], sem: BlockSemantics, grid: UnitGrid
) -> None:
    """Raise :class:`ComputeUnitError` unless ``grid`` nests with every compute grid in ``coarse``."""
    for other, og in coarse:
        both = og.combine(grid)
        if both != og and both != grid:
            raise ComputeUnitError(
                f"tensor {spec.name!r} of shape {spec.shape} gets compute units from {other.spec!r} "
                f"({_unit_text(og)}) and {sem.spec!r} ({_unit_text(grid)}), and neither is made of whole units "
                "of the other: one optimizer call cannot see both. Fix: give the tensor one of them (narrow "
                "the rules' name globs), or units that nest (rows:4 with rows:2, matrix with rows:k)"
            )


def _unit_text(g: UnitGrid) -> str:
    return "the whole tensor" if g.is_whole else f"units of {g.unit_numel:,} elements"
