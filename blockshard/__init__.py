"""blockshard: optimizer- and quantization-aware sharding.

``import blockshard`` is cheap and side-effect free: it initializes no CUDA context and no
process group (the pure layers do not even import torch).
"""

from typing import TYPE_CHECKING

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
    "stock_adamw_state_dict",
    "peft_state_dict",
    "quantized_stats",
    "precompute_quantized_gather",
    "quantized_gather_stats",
    "load_safetensors",
    "install_torch_routes",
    "uninstall_torch_routes",
    "installed_torch_routes",
    "global_shape",
    "global_shapes",
    "report",
    "Report",
    "collective_counts",
    "set_step_log",
)
_OPTIM = ("param_groups_by",)


if TYPE_CHECKING:  # what __getattr__ loads, as mypy sees it (`X as X`: exported)
    from blockshard.optim import param_groups_by as param_groups_by
    from blockshard.runtime import Report as Report
    from blockshard.runtime import check_finished as check_finished
    from blockshard.runtime import clip_grad_norm_ as clip_grad_norm_
    from blockshard.runtime import collective_counts as collective_counts
    from blockshard.runtime import full_state_dict as full_state_dict
    from blockshard.runtime import fully_shard as fully_shard
    from blockshard.runtime import global_shape as global_shape
    from blockshard.runtime import global_shapes as global_shapes
    from blockshard.runtime import group_layouts as group_layouts
    from blockshard.runtime import init_parameters as init_parameters
    from blockshard.runtime import install_torch_routes as install_torch_routes
    from blockshard.runtime import installed_torch_routes as installed_torch_routes
    from blockshard.runtime import is_sharded as is_sharded
    from blockshard.runtime import load_checkpoint as load_checkpoint
    from blockshard.runtime import load_optimizer_state_dict as load_optimizer_state_dict
    from blockshard.runtime import load_safetensors as load_safetensors
    from blockshard.runtime import optimizer_state_dict as optimizer_state_dict
    from blockshard.runtime import peft_state_dict as peft_state_dict
    from blockshard.runtime import precompute_quantized_gather as precompute_quantized_gather
    from blockshard.runtime import quantized_gather_stats as quantized_gather_stats
    from blockshard.runtime import quantized_stats as quantized_stats
    from blockshard.runtime import register_forward_method as register_forward_method
    from blockshard.runtime import report as report
    from blockshard.runtime import save_checkpoint as save_checkpoint
    from blockshard.runtime import save_pretrained as save_pretrained
    from blockshard.runtime import set_step_log as set_step_log
    from blockshard.runtime import sharded_state_dict as sharded_state_dict
    from blockshard.runtime import stock_adamw_state_dict as stock_adamw_state_dict
    from blockshard.runtime import uninstall_torch_routes as uninstall_torch_routes


def __getattr__(name: str) -> object:
    if name in _RUNTIME:
        from blockshard import runtime

        return getattr(runtime, name)
    if name in _OPTIM:
        from blockshard import optim

        return getattr(optim, name)
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
    *_OPTIM,
]
