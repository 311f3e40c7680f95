"""A sharded run's peak memory per rank, measured and predicted, to hold a plan to its budget.

Measured: the peak of tensor storage allocated inside the block and alive together (sharded
parameters made by wrapping, gradients, optimizer states, gathered parameters, activations).
On CUDA from the allocator's statistics (the peak above what was allocated on entry); on
other devices by watching every op (profiling/memory.py's ``LiveMemory``), so wrap the model
inside the block: the unsharded weights it starts from are not counted.

Predicted: the plan's model states (every unit's memory and the gather reserve) plus the
activation peak of the step's own micro-batches, as the cost model prices them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..cost.table import TableCostModel
from ..plan.sharding.shard_plan import ShardPlan
from ..profiling.memory import LiveMemory
from ..runtime.loader import Step


class PeakMemory:
    """``peak``: bytes, set when the ``measure`` block ends; ``live()``: bytes alive now (inside the block)."""

    peak: int = 0

    def live(self) -> int:
        return self._live()


@contextlib.contextmanager
def measure(device: torch.device | str = "cpu") -> Iterator[PeakMemory]:
    """Measure the peak of the block (see the module docstring)."""
    result = PeakMemory()
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result._live = lambda: torch.cuda.memory_allocated(device) - base
        yield result
        torch.cuda.synchronize(device)
        result.peak = torch.cuda.max_memory_allocated(device) - base
        return
    with LiveMemory() as live:
        result._live = lambda: live.live
        yield result
    result.peak = live.peak


def predicted_peak_bytes(plan: ShardPlan, cost: TableCostModel, steps: list[Step]) -> float:
    """The plan's model states plus the largest activation peak of the steps' micro-batches on this rank."""
    activations = max(
        cost.micro_batch_cost(d.seq_lens, layout=d.layout, recompute=d.recompute).peak_bytes
        for step in steps
        for d in step.loaded
    )
    return plan.state_bytes + activations
