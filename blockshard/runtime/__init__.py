"""The ragged engine: ``fully_shard`` with persistent zero-copy buffers."""

from blockshard._errors import (
    CheckpointError,
    ClipError,
    CollectiveIntegrityError,
    EngineStateError,
    LayoutMismatchError,
    OptimizerSetupError,
    PieceTensorError,
    ReportError,
    ShardingError,
    TorchRouteError,
)
from blockshard.runtime._api import (
    ShardedModule,
    UnshardHandle,
    fully_shard,
    global_shape,
    global_shapes,
    group_layouts,
    is_sharded,
    local_buffers,
)
from blockshard.runtime._report import Report, report
from blockshard.runtime.checkpoint._dcp import describe_checkpoint, load_checkpoint, save_checkpoint
from blockshard.runtime.checkpoint._export import save_pretrained
from blockshard.runtime.checkpoint._optim_state import load_optimizer_state_dict, optimizer_state_dict
from blockshard.runtime.checkpoint._peft import peft_state_dict
from blockshard.runtime.checkpoint._piece_tensor import PieceTensor
from blockshard.runtime.checkpoint._safetensors import LoadReport, load_safetensors
from blockshard.runtime.checkpoint._state_dict import (
    LocalShard,
    full_state_dict,
    load_full_state_dict,
    load_sharded_state_dict,
    sharded_state_dict,
)
from blockshard.runtime.checkpoint._stock_optim import stock_adamw_state_dict
from blockshard.runtime.core._clip import clip_grad_norm_
from blockshard.runtime.core._collectives import check_finished
from blockshard.runtime.core._common import ShardedState, TrainingState
from blockshard.runtime.core._init import init_parameters
from blockshard.runtime.core._inspect import collective_counts
from blockshard.runtime.core._module import register_forward_method
from blockshard.runtime.core._owners import TensorOwnerPlan, TensorOwners, owner_plan
from blockshard.runtime.core._traffic import CollectiveCount, StepLogError, TrafficMismatchError, set_step_log
from blockshard.runtime.quantized._frozen import QuantizedStats, quantized_stats
from blockshard.runtime.quantized._gather import full_quantized, precompute_quantized_gather, quantized_gather_stats
from blockshard.runtime.routes import install_torch_routes, installed_torch_routes, uninstall_torch_routes

__all__ = [
    "CheckpointError",
    "ClipError",
    "CollectiveCount",
    "CollectiveIntegrityError",
    "EngineStateError",
    "LayoutMismatchError",
    "LoadReport",
    "LocalShard",
    "OptimizerSetupError",
    "PieceTensor",
    "PieceTensorError",
    "QuantizedStats",
    "Report",
    "ReportError",
    "ShardedModule",
    "ShardedState",
    "ShardingError",
    "StepLogError",
    "TensorOwnerPlan",
    "TensorOwners",
    "TorchRouteError",
    "TrafficMismatchError",
    "TrainingState",
    "UnshardHandle",
    "check_finished",
    "clip_grad_norm_",
    "collective_counts",
    "describe_checkpoint",
    "full_quantized",
    "full_state_dict",
    "fully_shard",
    "global_shape",
    "global_shapes",
    "group_layouts",
    "init_parameters",
    "install_torch_routes",
    "installed_torch_routes",
    "is_sharded",
    "load_checkpoint",
    "load_full_state_dict",
    "load_optimizer_state_dict",
    "load_safetensors",
    "load_sharded_state_dict",
    "local_buffers",
    "optimizer_state_dict",
    "owner_plan",
    "peft_state_dict",
    "precompute_quantized_gather",
    "quantized_gather_stats",
    "quantized_stats",
    "register_forward_method",
    "report",
    "save_checkpoint",
    "save_pretrained",
    "set_step_log",
    "sharded_state_dict",
    "stock_adamw_state_dict",
    "uninstall_torch_routes",
]
