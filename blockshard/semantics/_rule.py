"""One :class:`Rule`: which tensors get which semantics (the matching itself; combining the
semantics of every matching rule is ``SemanticsRules`` in _rules.py)."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field

from blockshard._errors import SemanticsError
from blockshard.semantics._base import BlockSemantics, SemanticsKind
from blockshard.semantics._registry import get_semantics
from blockshard.semantics._spec import TensorSpec

__all__ = ["CallableRule", "Rule", "call_user_semantics", "callable_name", "is_embedding_or_head"]


# Embeddings and the output head: Muon leaves them to AdamW (Keller Jordan's Muon, Moonlight) and
# quantizers leave them unquantized (bitsandbytes / QLoRA skip lm_head and embeddings).
_EMBED_OR_HEAD = ("*embed*", "*lm_head*", "*wte*", "*wpe*", "*output.weight", "*tok_embeddings*", "*word_embeddings*")


def is_embedding_or_head(spec: TensorSpec) -> bool:
    return spec.module_type == "Embedding" or any(fnmatch.fnmatchcase(spec.name, g) for g in _EMBED_OR_HEAD)


CallableRule = Callable[[str, TensorSpec], "str | BlockSemantics | None"]


class _CallableRaised(SemanticsError):
    """A user's semantics callable raised; the message already names the parameter (never wrapped twice)."""


def call_user_semantics(
    fn: Callable[..., object],
    args: tuple[object, ...],
    name: str,
    shape: tuple[int, ...],
    role: str = "semantics callable",
) -> object:
    """``fn(*args)`` for parameter ``name``; an exception from it becomes a :class:`SemanticsError` naming
    the callable, the parameter and its shape (``role``: what the callable is to the user)."""
    try:
        return fn(*args)
    except _CallableRaised:
        raise
    except Exception as exc:
        raise _CallableRaised(
            f"{role} {callable_name(fn)} raised on parameter {name!r} (shape {tuple(shape)}): "
            f"{type(exc).__name__}: {exc}; fix the callable"
        ) from exc


def callable_name(fn: object) -> str:
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


def _type_name(t: str | type) -> str:
    return t if isinstance(t, str) else t.__name__
