"""blockshard: optimizer- and quantization-aware sharding.

``import blockshard`` is cheap and side-effect free: it initializes no CUDA context and no
process group (the pure layers do not even import torch).
"""

from blockshard._errors import (
    BlockshardError,
    ComputeUnitError,
    PlanError,
    QuantizedWeightError,
    SemanticsError,
    ShapesError,
    TorchRouteError,
    WorldSizeError,
)
from blockshard._version import __version__ as __version__
from blockshard.semantics import (
    BlockSemantics,
    Companion,
    Rule,
    SemanticsKind,
    SemanticsRules,
    TensorSpec,
    UnitGrid,
    get_semantics,
    register_semantics,
    registered_semantics,
)

# The engine imports torch; it loads on first use so that `import blockshard` stays light.
_RUNTIME = (
    "fully_shard",
    "clip_grad_norm_",
    "full_state_dict",
    "sharded_state_dict",
    "is_sharded",
    "group_layouts",
    "save_checkpoint",
    "load_checkpoint",
    "optimizer_state_dict",
    "load_optimizer_state_dict",
    "register_forward_method",
    "init_parameters",
    "check_finished",
    "save_pretrained",
    "quantized_stats",
    "precompute_quantized_gather",
    "quantized_gather_stats",
    "load_safetensors",
    "install_torch_routes",
    "uninstall_torch_routes",
    "installed_torch_routes",
)


def __getattr__(name: str):
    if name in _RUNTIME:
        from blockshard import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'blockshard' has no attribute {name!r}")


__all__ = [
    "BlockshardError",
    "ComputeUnitError",
    "PlanError",
    "QuantizedWeightError",
    "SemanticsError",
    "ShapesError",
    "TorchRouteError",
    "WorldSizeError",
    "BlockSemantics",
    "Companion",
    "Rule",
    "SemanticsKind",
    "SemanticsRules",
    "TensorSpec",
    "UnitGrid",
    "get_semantics",
    "register_semantics",
    "registered_semantics",
    *_RUNTIME,
]
