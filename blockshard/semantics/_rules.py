"""Rules that give each parameter its block semantics.

A :class:`Rule` matches by name glob, module type, tensor type, the optimizer's ``param_group`` and/or
a predicate (all given criteria must hold). A callable ``(name, tensor_spec) -> semantics | None`` is
a rule too. Every matching rule applies: their grids combine to the least common unit
(:meth:`UnitGrid.combine`); two different optimizers or two different quantizers on one tensor
are a conflict and raise :class:`~blockshard.SemanticsError` naming both and the tensor.
Tensors no rule matches are ``elementwise``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from blockshard._errors import SemanticsError
from blockshard.semantics._base import BlockSemantics, Companion, SemanticsKind
from blockshard.semantics._grid import GridError, UnitGrid
from blockshard.semantics._registry import get_semantics
from blockshard.semantics._spec import TensorSpec

__all__ = ["ResolvedSemantics", "Rule", "SemanticsRules", "call_user_semantics", "is_embedding_or_head"]

# Embeddings and the output head: Muon leaves them to AdamW (Keller Jordan's Muon, Moonlight) and
# quantizers leave them unquantized (bitsandbytes / QLoRA skip lm_head and embeddings).
_EMBED_OR_HEAD = ("*embed*", "*lm_head*", "*wte*", "*wpe*", "*output.weight", "*tok_embeddings*", "*word_embeddings*")


def is_embedding_or_head(spec: TensorSpec) -> bool:
    return spec.module_type == "Embedding" or any(fnmatch.fnmatchcase(spec.name, g) for g in _EMBED_OR_HEAD)


CallableRule = Callable[[str, TensorSpec], "str | BlockSemantics | None"]


class _CallableRaised(SemanticsError):
    """A user's semantics callable raised; the message already names the parameter (never wrapped twice)."""


def call_user_semantics(
    fn: Callable, args: tuple, name: str, shape: tuple[int, ...], role: str = "semantics callable"
) -> object:
    """``fn(*args)`` for parameter ``name``; an exception from it becomes a :class:`SemanticsError` naming
    the callable, the parameter and its shape (``role``: what the callable is to the user)."""
    try:
        return fn(*args)
    except _CallableRaised:
        raise
    except Exception as exc:
        raise _CallableRaised(
            f"{role} {_callable_name(fn)} raised on parameter {name!r} (shape {tuple(shape)}): "
            f"{type(exc).__name__}: {exc}; fix the callable"
        ) from exc


def _callable_name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


@dataclass(frozen=True, kw_only=True)
class Rule:
    """Give ``semantics`` to every tensor that matches all the criteria given.

    Args:
        semantics: a registered semantics string (``"nf4"``, ``"shampoo:1024"``) or a ``BlockSemantics``.
        name: an ``fnmatch`` glob on the parameter name (``"*.mlp.*.weight"``).
        module_type: class (or class name) of the module holding the tensor.
        tensor_type: class (or class name) of the tensor (``"Params4bit"``).
        param_group: index of the optimizer's ``param_group``.
        predicate: any further test on the ``TensorSpec``.
        blanket: skip tensors the semantics does not handle instead of failing on them: fewer
            dims than its ``min_ndim``, and for quantizers embeddings and the output head (as
            QLoRA leaves them); used by bare semantics names such as ``--semantics fp8_block:128``.
    """

    semantics: str | BlockSemantics
    name: str | None = None
    module_type: str | type | None = None
    tensor_type: str | type | None = None
    param_group: int | None = None
    predicate: Callable[[TensorSpec], bool] | None = None
    blanket: bool = False
    _resolved: BlockSemantics = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_resolved", get_semantics(self.semantics))

    @property
    def block_semantics(self) -> BlockSemantics:
        return self._resolved

    def matches(self, spec: TensorSpec) -> bool:
        if self.name is not None and not fnmatch.fnmatchcase(spec.name, self.name):
            return False
        if self.module_type is not None and spec.module_type != _type_name(self.module_type):
            return False
        if self.tensor_type is not None and spec.tensor_type != _type_name(self.tensor_type):
            return False
        if self.param_group is not None and spec.param_group != self.param_group:
            return False
        if self.blanket and (
            len(spec.shape) < self._resolved.min_ndim
            or (self._resolved.kind is SemanticsKind.QUANTIZER and is_embedding_or_head(spec))
        ):
            return False
        if self.predicate is None:
            return True
        return bool(call_user_semantics(self.predicate, (spec,), spec.name, spec.shape, "Rule predicate"))


def _returned_semantics(rule: Callable, out: object, spec: TensorSpec) -> BlockSemantics:
    try:
        return get_semantics(out)  # type: ignore[arg-type]
    except SemanticsError as exc:
        raise SemanticsError(
            f"semantics callable {_callable_name(rule)} returned {out!r} for parameter {spec.name!r} (shape {spec.shape}): "
            f"{exc}. Fix the callable"
        ) from None


def _grid_of(sem: BlockSemantics, spec: TensorSpec) -> UnitGrid:
    """``sem``'s grid of ``spec``, checked: a custom semantics' mistake names the semantics and the tensor."""
    where = f"semantics {sem.spec!r} ({type(sem).__qualname__}) on tensor {spec.name!r} of shape {spec.shape}"
    try:
        grid = sem.grid(spec.shape, spec.dtype, tensor=spec.name)
    except GridError as exc:
        raise SemanticsError(f"{where}: {exc}") from None
    except SemanticsError:
        raise  # a semantics' own error (BlockSemantics.error) already names the tensor
    except Exception as exc:
        raise SemanticsError(f"{where}: grid() raised {type(exc).__name__}: {exc}; fix the semantics") from exc
    if not isinstance(grid, UnitGrid) or grid.numel != spec.numel:
        got = f"a grid of {grid.numel} elements" if isinstance(grid, UnitGrid) else repr(grid)
        raise SemanticsError(
            f"{where}: grid() returned {got}, not a UnitGrid of the tensor's {spec.numel} elements; fix its "
            "grid() to return UnitGrid.units(math.prod(shape), unit_numel) or UnitGrid.whole(math.prod(shape))"
        )
    return grid


def _type_name(t: str | type) -> str:
    return t if isinstance(t, str) else t.__name__


@dataclass(frozen=True)
class ResolvedSemantics:
    """The semantics a tensor ended up with: its combined grid, cost and companions."""

    semantics: tuple[BlockSemantics, ...]
    grid: UnitGrid
    cost: float
    companions: tuple[Companion, ...]

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
        from blockshard.semantics._presets import PRESETS

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
        grid = UnitGrid.units(spec.numel, 1)
        companions: list[Companion] = []
        for s in sems:
            grid = grid.combine(_grid_of(s, spec))
            companions.extend(s.companions(spec.shape, spec.dtype))
        costly = by_kind.get(SemanticsKind.OPTIMIZER)
        cost = costly.cost(spec.shape, spec.dtype) if costly else float(spec.numel)
        return ResolvedSemantics(tuple(sems), grid, cost, tuple(companions))

    def __repr__(self) -> str:
        return f"SemanticsRules({list(self.rules)!r})"
