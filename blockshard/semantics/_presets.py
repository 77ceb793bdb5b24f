"""Presets: named sets of rules for common optimizer setups (``--semantics muon``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from blockshard.semantics._registry import PRESET_NAMES
from blockshard.semantics._rule import Rule, is_embedding_or_head
from blockshard.semantics._spec import TensorSpec

__all__ = ["PRESETS"]


def _hidden(spec: TensorSpec) -> bool:
    """Not an embedding, the head or a bias (GPT-OSS stacks expert biases as 2-D ``(E, n)``)."""
    return not is_embedding_or_head(spec) and not spec.name.endswith("bias")


def _muon() -> list[Rule]:
    """Muon on hidden weights: a 2-D weight is one whole matrix, a stacked ``(E, m, n)`` expert
    weight one matrix per expert; embeddings, head, norms and biases stay element-wise (AdamW)."""
    return [
        Rule(semantics="matrix", predicate=lambda s: len(s.shape) in (2, 3) and _hidden(s)),
        Rule(semantics="expert", predicate=lambda s: len(s.shape) == 3 and _hidden(s)),
    ]


def _adamw() -> list[Rule]:
    """AdamW everywhere: element-wise."""
    return [Rule(semantics="elementwise")]


#: Read-only: a preset is a name on the command line; pass your own rules where rules are accepted.
PRESETS: Mapping[str, Callable[[], list[Rule]]] = MappingProxyType({"muon": _muon, "adamw": _adamw})
assert set(PRESETS) == PRESET_NAMES  # the registry names them for its error message
