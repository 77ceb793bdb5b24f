"""The planner: pure (no process group) layouts, owner plans, baselines and reports."""

from blockshard.planner._baselines import BASELINES, BaselineResult, baseline, combine
from blockshard.planner._buckets import plan_buckets
from blockshard.planner._catalog import (
    catalog_config,
    catalog_models,
    default_group,
    model_tensors,
    tensors_from_hf_config,
)
from blockshard.planner._items import PlanItem, resolve_items
from blockshard.planner._lay_out import alignment_numel, plan_group
from blockshard.planner._layout import GroupLayout, Piece, TensorPlacement
from blockshard.planner._ordered import OrderedLayout, ordered_layout
from blockshard.planner._owner import OwnerPlan, plan_owners
from blockshard.planner._pack import lower_bound, pack
from blockshard.planner._parallel import ParallelPlan, Placement, SplitUnit, plan_parallel
from blockshard.planner._plan import ModelPlan, group_kind, plan_model
from blockshard.planner._report import Comparison, KindRow, compare
from blockshard.planner._shapes_file import load_model_tensors, tensors_from_shapes_file

__all__ = [
    "BASELINES",
    "BaselineResult",
    "Comparison",
    "GroupLayout",
    "KindRow",
    "ModelPlan",
    "OrderedLayout",
    "OwnerPlan",
    "ParallelPlan",
    "Piece",
    "Placement",
    "PlanItem",
    "SplitUnit",
    "TensorPlacement",
    "alignment_numel",
    "baseline",
    "catalog_config",
    "catalog_models",
    "combine",
    "compare",
    "default_group",
    "group_kind",
    "load_model_tensors",
    "lower_bound",
    "model_tensors",
    "ordered_layout",
    "pack",
    "plan_buckets",
    "plan_group",
    "plan_model",
    "plan_owners",
    "plan_parallel",
    "resolve_items",
    "tensors_from_hf_config",
    "tensors_from_shapes_file",
]
