"""Block semantics: the indivisible units optimizers and quantizers compute on."""

from blockshard.semantics import _builtins, _quantizers  # noqa: F401  (register the built-ins)
from blockshard.semantics._base import BlockSemantics, Companion, SemanticsKind
from blockshard.semantics._builtins import fused_parts, newton_schulz_flops, straddled_boundary
from blockshard.semantics._grid import UnitGrid
from blockshard.semantics._optimizers import blockwise_state_semantics, tile_state_semantics
from blockshard.semantics._presets import PRESETS
from blockshard.semantics._registry import (
    ENTRY_POINT_GROUP,
    NO_ENTRY_POINTS_ENV,
    get_semantics,
    register_semantics,
    registered_semantics,
    reload_entry_points,
    unregister_semantics,
)
from blockshard.semantics._rule import Rule
from blockshard.semantics._rules import ResolvedSemantics, SemanticsRules
from blockshard.semantics._spec import DTYPE_ITEMSIZE, DTypeLike, TensorSpec, itemsize_of, normalize_dtype
from blockshard.semantics._storage import ByteSection, ByteStream, QuantizedStorage, storage_with_companions

__all__ = [
    "DTYPE_ITEMSIZE",
    "ENTRY_POINT_GROUP",
    "NO_ENTRY_POINTS_ENV",
    "PRESETS",
    "BlockSemantics",
    "ByteSection",
    "ByteStream",
    "Companion",
    "DTypeLike",
    "QuantizedStorage",
    "ResolvedSemantics",
    "Rule",
    "SemanticsKind",
    "SemanticsRules",
    "TensorSpec",
    "UnitGrid",
    "blockwise_state_semantics",
    "fused_parts",
    "get_semantics",
    "itemsize_of",
    "newton_schulz_flops",
    "normalize_dtype",
    "register_semantics",
    "registered_semantics",
    "reload_entry_points",
    "storage_with_companions",
    "straddled_boundary",
    "tile_state_semantics",
    "unregister_semantics",
]
