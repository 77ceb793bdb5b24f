"""The ragged engine: ``fully_shard`` with persistent zero-copy buffers."""

from blockshard.runtime._api import (
    ShardedModule,
    ShardingError,
    UnshardHandle,
    fully_shard,
    global_shapes,
    group_layouts,
    is_sharded,
    local_buffers,
)
from blockshard.runtime._checkpoint import CheckpointError, describe_checkpoint, load_checkpoint, save_checkpoint
from blockshard.runtime._clip import ClipError, clip_grad_norm_
from blockshard.runtime._collectives import CollectiveIntegrityError, LayoutMismatchError, check_finished
from blockshard.runtime._common import EngineStateError, ShardedState, TrainingState
from blockshard.runtime._export import save_pretrained
from blockshard.runtime._init import init_parameters
from blockshard.runtime._module import register_forward_method
from blockshard.runtime._optim_state import load_optimizer_state_dict, optimizer_state_dict
from blockshard.runtime._owners import TensorOwners, owner_plan
from blockshard.runtime._piece_tensor import PieceTensor, PieceTensorError
from blockshard.runtime._quantized import QuantizedStats, quantized_stats
from blockshard.runtime._quantized_gather import full_quantized, precompute_quantized_gather, quantized_gather_stats
from blockshard.runtime._safetensors import LoadReport, load_safetensors
from blockshard.runtime._state_dict import (
    LocalShard,
    full_state_dict,
    load_full_state_dict,
    load_sharded_state_dict,
    sharded_state_dict,
)

__all__ = [
    "CheckpointError",
    "ClipError",
    "CollectiveIntegrityError",
    "EngineStateError",
    "LayoutMismatchError",
    "LoadReport",
    "LocalShard",
    "PieceTensor",
    "PieceTensorError",
    "QuantizedStats",
    "ShardedModule",
    "ShardedState",
    "ShardingError",
    "TensorOwners",
    "TrainingState",
    "UnshardHandle",
    "check_finished",
    "clip_grad_norm_",
    "describe_checkpoint",
    "full_quantized",
    "full_state_dict",
    "fully_shard",
    "global_shapes",
    "group_layouts",
    "init_parameters",
    "is_sharded",
    "load_checkpoint",
    "load_full_state_dict",
    "load_optimizer_state_dict",
    "load_safetensors",
    "load_sharded_state_dict",
    "local_buffers",
    "optimizer_state_dict",
    "owner_plan",
    "precompute_quantized_gather",
    "quantized_gather_stats",
    "quantized_stats",
    "register_forward_method",
    "save_checkpoint",
    "save_pretrained",
    "sharded_state_dict",
]
