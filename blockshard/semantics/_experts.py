"""Stacked expert tensors: which tensors they are, and per-expert grids.

[Note: stacked experts]
transformers 5.x keeps a MoE layer's experts as 3-D parameters of one module: Mixtral and
DeepSeek-V3 ``mlp.experts.gate_up_proj`` ``(E, 2*I, H)``, GPT-OSS ``(E, H, 2*I)`` (see
``planner/_catalog.py``). On such a tensor a user means ``matrix`` (Muon), ``shampoo:D``,
``rows:k`` and ``fp8_block:B`` per expert: each expert's ``shape[1:]`` is one matrix.

The rule: a tensor is a **stacked expert tensor** when it has at least 3 dims and

1. one of its semantics is ``expert`` (the user said so), or
2. its module's class name ends in ``Experts`` (``MixtralExperts``, ``DeepseekV3Experts``,
   ``GptOssExperts``: what the catalog and the engine record as ``TensorSpec.module_type``), or
3. it is a parameter of a module named ``experts`` (``*.experts.gate_up_proj``: a shapes file
   without module types).

Any other tensor of 3 or more dims (a convolution's ``(out, in, k)``) keeps the semantics'
plain behaviour on its full shape. A semantics with ``per_expert = True`` then gives the grids
of one expert, repeated ``E`` times (:func:`repeat_grid`), and ``E`` times one expert's cost.
"""

from __future__ import annotations

from collections.abc import Sequence

from blockshard.semantics._base import BlockSemantics
from blockshard.semantics._grid import UnitGrid
from blockshard.semantics._spec import TensorSpec

__all__ = ["is_stacked_experts", "repeat_grid"]

EXPERT_MODULE_SUFFIX = "Experts"


def is_stacked_experts(spec: TensorSpec, sems: Sequence[BlockSemantics] = ()) -> bool:
    """Whether ``spec`` is a stacked ``(E, ...)`` expert tensor (see [Note: stacked experts])."""
    if len(spec.shape) < 3:
        return False
    if any(s.name_of() == "expert" for s in sems):
        return True
    if spec.module_type is not None and spec.module_type.endswith(EXPERT_MODULE_SUFFIX):
        return True
    parts = spec.name.split(".")
    return len(parts) >= 2 and parts[-2] == "experts"


def repeat_grid(one: UnitGrid, experts: int) -> UnitGrid:
    """The grid of ``experts`` stacked copies of a tensor whose grid is ``one``.

    Units that tile one expert exactly repeat as they are; otherwise (a whole expert, a shorter
    last stripe, a minimum piece) one expert is the unit: every expert boundary is a cut.
    """
    n = one.numel
    total = n * experts
    if total == 0:
        return UnitGrid.whole(0)
    if not one.is_whole and n % one.unit_numel == 0 and one == UnitGrid.units(n, one.unit_numel):
        return UnitGrid.units(total, one.unit_numel)
    return UnitGrid.units(total, n)
