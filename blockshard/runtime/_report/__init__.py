"""``blockshard.report``: what was really sharded, replicated and stepped ([Note: run report] in _model.py)."""

from blockshard._errors import ReportError
from blockshard.runtime._report._build import report
from blockshard.runtime._report._external import (
    ComputeTensors,
    PartitionGroup,
    PartitionSource,
    PlacementNote,
    placement_note,
    tag_placement,
)
from blockshard.runtime._report._model import GroupRow, OptimizerRow, ParamRow, Report, StateRow
from blockshard.runtime._report._show import plot, render

__all__ = [
    "ComputeTensors",
    "GroupRow",
    "OptimizerRow",
    "ParamRow",
    "PartitionGroup",
    "PartitionSource",
    "PlacementNote",
    "Report",
    "ReportError",
    "StateRow",
    "placement_note",
    "plot",
    "render",
    "report",
    "tag_placement",
]
