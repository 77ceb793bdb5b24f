"""Block-aware optimizers and the semantics optimizers need.

``BlockedShampoo``: a reference blocked Shampoo (no distributed Shampoo package is on PyPI).
``optimizer_semantics`` / ``muon_param_groups``: the block semantics ``fully_shard`` should use
for the optimizers you plan to run. The owner-compute wrapper for engines that keep
element-wise shards lives with its engine (``blockshard.integrations.fsdp2``).
"""

from blockshard.optim._semantics import (
    OPTIMIZER_SEMANTICS,
    muon_param_groups,
    optimizer_semantics,
    semantics_for_optimizer,
)
from blockshard.optim._shampoo import BlockedShampoo

__all__ = [
    "OPTIMIZER_SEMANTICS",
    "BlockedShampoo",
    "muon_param_groups",
    "optimizer_semantics",
    "semantics_for_optimizer",
]
