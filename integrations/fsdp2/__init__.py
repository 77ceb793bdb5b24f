"""``blockshard.integrations.fsdp2``: stock ``torch.distributed.fsdp.fully_shard``, made block-aware.

* :func:`fully_shard` / :func:`block_placement_fn`: a ``shard_placement_fn`` that keeps each
  parameter's units (quantization blocks, optimizer blocks) whole where FSDP2's ``torch.chunk``
  boundaries allow it, marks whole-unit optimizer parameters (Muon's matrices) for owner-compute,
  and raises :class:`FSDP2PlacementError` naming the parameter where stock FSDP2 cannot be
  block-aligned (use ``blockshard.fully_shard``, the ragged engine, there).
* :class:`OwnerComputeOptimizer`: moves the gradient pieces of split units to one owner per unit
  (``all_to_all_single``), runs an unmodified optimizer (``torch.optim.Muon``, bitsandbytes
  ``AdamW8bit``, AdamW) on whole units and local views, and moves the new values back.

Example (Muon on hidden matrices, AdamW on the rest)::

    from blockshard.integrations import fsdp2
    from blockshard.optim import muon_param_groups

    for block in model.blocks:
        fsdp2.fully_shard(block, semantics="muon", root=model)
    fsdp2.fully_shard(model, semantics="muon")
    muon_group, rest = muon_param_groups(model)  # by name and global shape, never by p.ndim
    muon = fsdp2.OwnerComputeOptimizer(lambda g: torch.optim.Muon(g, lr=0.02), [muon_group], semantics="matrix")
    adamw = fsdp2.OwnerComputeOptimizer(lambda g: torch.optim.AdamW(g, lr=1e-3), [rest])

A DTensor's ``ndim`` is its global one, so ``p.ndim == 2`` would hand Muon the embedding and the
output head; ``muon_param_groups`` leaves them to AdamW (tests/optim/test_selection.py runs this).
"""

from ._owner_compute import OwnerComputeError, OwnerComputeOptimizer, build_exchange
from ._placement import (
    FSDP2PlacementError,
    ParamPlacement,
    block_placement_fn,
    decide,
    dim_split_keeps_units,
    fully_shard,
    owner_computable,
    place,
    placements,
    plan_placements,
    shard0_boundaries,
)

__all__ = [
    "FSDP2PlacementError",
    "OwnerComputeError",
    "OwnerComputeOptimizer",
    "ParamPlacement",
    "block_placement_fn",
    "build_exchange",
    "decide",
    "dim_split_keeps_units",
    "fully_shard",
    "owner_computable",
    "place",
    "placements",
    "plan_placements",
    "shard0_boundaries",
]
