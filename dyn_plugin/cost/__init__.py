"""Cost models: what a micro-batch costs on one pipeline stage, in time and memory."""

from .model import (
    CostModel,
    Layout,
    MicroBatchCost,
    ModelStateBytes,
    OutOfProfileRange,
    Recompute,
    StageSpec,
    features,
    split_layers,
)
from .table import CostTable, LinearFit, TableCostModel

__all__ = [
    "CostModel",
    "CostTable",
    "Layout",
    "LinearFit",
    "MicroBatchCost",
    "ModelStateBytes",
    "OutOfProfileRange",
    "Recompute",
    "StageSpec",
    "TableCostModel",
    "features",
    "split_layers",
]
