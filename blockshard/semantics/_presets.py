"""Presets: named sets of rules for common optimizer setups (``--semantics muon``)."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

from blockshard.semantics._rules import Rule
from blockshard.semantics._spec import TensorSpec

__all__ = ["PRESETS", "is_embedding_or_head"]

# Parameters Muon leaves to AdamW: embeddings and the output head (Keller Jordan's Muon, Moonlight).
_EMBED_OR_HEAD = ("*embed*", "*lm_head*", "*wte*", "*wpe*", "*output.weight", "*tok_embeddings*", "*word_embeddings*")


def is_embedding_or_head(spec: TensorSpec) -> bool:
    return spec.module_type == "Embedding" or any(fnmatch.fnmatchcase(spec.name, g) for g in _EMBED_OR_HEAD)


def _muon() -> list[Rule]:
    """Muon on 2-D hidden weights (whole matrices); embeddings, head, norms and biases element-wise (AdamW)."""
    return [Rule(semantics="matrix", predicate=lambda s: len(s.shape) == 2 and not is_embedding_or_head(s))]


def _adamw() -> list[Rule]:
    """AdamW everywhere: element-wise."""
    return [Rule(semantics="elementwise")]


PRESETS: dict[str, Callable[[], list[Rule]]] = {"muon": _muon, "adamw": _adamw}
