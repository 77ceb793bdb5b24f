"""Block-aware optimizers and the semantics optimizers need.

``BlockedShampoo``: a reference blocked Shampoo (no distributed Shampoo package is on PyPI).
``optimizer_semantics`` / ``muon_param_groups``: the block semantics ``fully_shard`` should use
for the optimizers you plan to run. ``Muon``: ``torch.optim.Muon`` with its momentum on the storage shards (only directions and
updates move). ``OwnerComputeOptimizer``: an unmodified optimizer on whole
compute units of cut storage (the ragged engine's ``policy="owner" | "auto"``; FSDP2's adapter,
``blockshard.integrations.fsdp2``, uses the same implementation). ``rebind_optimizer``: an
optimizer built before sharding, pointed at the pieces (Accelerate's ``prepare`` calls it).
``param_groups_by``: param_groups by name and global shape, as on one process. ``MuonWithAdamW``:
torch's Muon and AdamW as one optimizer, by param_group (for code that takes one optimizer: DeepSpeed,
the HF Trainer).
"""

from blockshard.optim._groups import param_groups_by
from blockshard.optim._muon import Muon
from blockshard.optim._muon_adamw import MuonWithAdamW
from blockshard.optim._owner_compute import OwnerComputeError
from blockshard.optim._owner_optimizer import OwnerComputeOptimizer
from blockshard.optim._rebind import rebind_optimizer
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
    "Muon",
    "MuonWithAdamW",
    "OwnerComputeError",
    "OwnerComputeOptimizer",
    "muon_param_groups",
    "optimizer_semantics",
    "param_groups_by",
    "rebind_optimizer",
    "semantics_for_optimizer",
]
