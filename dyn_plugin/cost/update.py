"""What a step costs after its micro-batches: the gradient all-reduce and the optimizer step.

Both are measured by the profiler: one AdamW step of the profiled model at its depths (ms per
parameter updated), and an all-reduce among ``ranks`` local processes on the backend training
uses (gloo on CPU) at a few sizes (ms per byte; collective.py). Without a measurement the
all-reduce is priced from the cluster's link bandwidth (a ring moves 2 (dp-1)/dp of the bytes)
and the optimizer step is left out, so the A100 import and the analytic model claim nothing
they did not measure.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class UpdateCost:
    optimizer: tuple[float, float] | None = None  # ms = c0 + c1 * parameters this rank updates
    allreduce: tuple[float, float] | None = None  # ms = c0 + c1 * bytes, among `ranks` processes
    ranks: int = 2

    def optimizer_ms(self, params: float) -> float:
        if self.optimizer is None:
            return 0.0
        return self.optimizer[0] + self.optimizer[1] * params

    def allreduce_ms(self, nbytes: float, dp: int, link_gb_per_s: float) -> float:
        if dp <= 1:
            return 0.0
        ring = 2 * (dp - 1) / dp
        if self.allreduce is None:
            return ring * nbytes / (link_gb_per_s * 1e9) * 1e3
        measured_ring = 2 * (self.ranks - 1) / self.ranks
        return self.allreduce[0] + self.allreduce[1] * nbytes * ring / measured_ring

    def to_dict(self) -> dict:
        return {"optimizer": self.optimizer, "allreduce": self.allreduce, "ranks": self.ranks}

    @classmethod
    def from_dict(cls, d: dict | None) -> "UpdateCost":
        d = d or {}
        pair = lambda v: None if v is None else (float(v[0]), float(v[1]))  # noqa: E731
        return cls(pair(d.get("optimizer")), pair(d.get("allreduce")), int(d.get("ranks", 2)))

    @classmethod
    def fit(cls, optimizer: Sequence[Sequence[float]] | None, allreduce: Sequence[Sequence[float]] | None,
            ranks: int) -> "UpdateCost":
        """From measured (parameters, ms) and (bytes, ms) points: least squares, intercept >= 0."""
        return cls(fit_line(optimizer), fit_line(allreduce), ranks)


def fit_line(points: Sequence[Sequence[float]] | None) -> tuple[float, float] | None:
    """(c0, c1) of y = c0 + c1 * x through measured (x, y) points; None without points."""
    if not points:
        return None
    x, y = np.asarray(points, dtype=float).T
    if len(set(x)) < 2:
        return (0.0, float(np.mean(y / x)))
    slope, intercept = np.polyfit(x, y, 1)
    if intercept < 0:  # a line through the origin instead of a negative fixed cost
        return (0.0, float(x @ y / (x @ x)))
    return (float(intercept), float(slope))
