"""The ragged engine: ``fully_shard`` with persistent zero-copy buffers."""

from blockshard.runtime._api import (
    LocalShard,
    ShardedModule,
    ShardingError,
    full_state_dict,
    fully_shard,
    group_layouts,
    is_sharded,
    load_full_state_dict,
    load_sharded_state_dict,
    local_buffers,
    sharded_state_dict,
)
from blockshard.runtime._collectives import LayoutMismatchError

__all__ = [
    "LocalShard",
    "ShardedModule",
    "ShardingError",
    "LayoutMismatchError",
    "full_state_dict",
    "fully_shard",
    "group_layouts",
    "is_sharded",
    "load_full_state_dict",
    "load_sharded_state_dict",
    "local_buffers",
    "sharded_state_dict",
]
