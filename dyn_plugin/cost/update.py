"""What a step costs in collectives and after its micro-batches: the gradient all-reduce, the
sharded data-parallel all-gather and reduce-scatter, and the optimizer step.

All are measured by the profiler: one AdamW step of the profiled model at its depths (ms per
parameter updated), and each collective among ``ranks`` local processes on the backend training
uses (gloo on CPU) at a few sizes (ms per byte; collective.py). Bytes are those of the whole
buffer per rank: the all-reduced gradients, the gathered parameters, the gradients before they
are reduce-scattered. Without a measurement a collective is priced from the link bandwidth of a
ring (an all-reduce moves 2 (n-1)/n of the bytes, an all-gather or a reduce-scatter (n-1)/n;
each of the ring's steps pays the link latency, where one is given) and the optimizer step is
left out, so the A100 import and the analytic model claim nothing they did not measure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .model import ModelStateBytes, Precision, zero_sharded_states

Line = tuple[float, float]  # ms = c0 + c1 * x


@dataclass(frozen=True)
class UpdateCost:
    optimizer: Line | None = None  # ms = c0 + c1 * parameters this rank updates
    allreduce: Line | None = None  # ms = c0 + c1 * bytes, among `ranks` processes
    ranks: int = 2
    allgather: Line | None = None  # ms = c0 + c1 * gathered bytes (the whole buffer), among `ranks`
    reducescatter: Line | None = None  # ms = c0 + c1 * bytes reduced (the whole buffer), among `ranks`

    def optimizer_ms(self, params: float) -> float:
        if self.optimizer is None:
            return 0.0
        return self.optimizer[0] + self.optimizer[1] * params

    def allreduce_ms(self, nbytes, dp: int, link_gb_per_s: float, latency_us: float = 0.0):
        """All-reduce of ``nbytes`` among ``dp`` ranks (``nbytes`` may be an array)."""
        return _ring(self.allreduce, self.ranks, 2.0, nbytes, dp, link_gb_per_s, latency_us)

    def allgather_ms(self, nbytes, n: int, link_gb_per_s: float, latency_us: float = 0.0):
        """All-gather of a buffer of ``nbytes`` (the gathered whole) among ``n`` ranks."""
        return _ring(self.allgather, self.ranks, 1.0, nbytes, n, link_gb_per_s, latency_us)

    def reducescatter_ms(self, nbytes, n: int, link_gb_per_s: float, latency_us: float = 0.0):
        """Reduce-scatter of a buffer of ``nbytes`` (the whole, before scattering) among ``n`` ranks."""
        return _ring(self.reducescatter, self.ranks, 1.0, nbytes, n, link_gb_per_s, latency_us)

    def to_dict(self) -> dict:
        d = {"optimizer": self.optimizer, "allreduce": self.allreduce, "ranks": self.ranks}
        # only when measured: files written before these existed stay as they were
        d.update({k: v for k, v in (("allgather", self.allgather), ("reducescatter", self.reducescatter)) if v})
        return d

    @classmethod
    def from_dict(cls, d: dict | None) -> "UpdateCost":
        d = d or {}
        pair = lambda v: None if v is None else (float(v[0]), float(v[1]))  # noqa: E731
        return cls(
            pair(d.get("optimizer")),
            pair(d.get("allreduce")),
            int(d.get("ranks", 2)),
            pair(d.get("allgather")),
            pair(d.get("reducescatter")),
        )

    @classmethod
    def fit(
        cls,
        optimizer: Sequence[Sequence[float]] | None,
        allreduce: Sequence[Sequence[float]] | None,
        ranks: int,
        allgather: Sequence[Sequence[float]] | None = None,
        reducescatter: Sequence[Sequence[float]] | None = None,
    ) -> "UpdateCost":
        """From measured (parameters, ms) and (bytes, ms) points: least squares, intercept >= 0."""
        return cls(fit_line(optimizer), fit_line(allreduce), ranks, fit_line(allgather), fit_line(reducescatter))


def _ring(measured: Line | None, ranks: int, passes: float, nbytes, n: int, link_gb_per_s: float, latency_us: float):
    """A ring collective that moves ``passes * (n-1)/n`` of ``nbytes`` per rank in ``passes * (n-1)``
    steps: the measured line scaled from ``ranks`` to ``n`` by that factor, else the link's time."""
    if n <= 1:
        return 0.0 * nbytes
    share = passes * (n - 1) / n
    if measured is None:
        return share * nbytes / (link_gb_per_s * 1e9) * 1e3 + passes * (n - 1) * latency_us / 1e3
    return measured[0] + measured[1] * nbytes * share / (passes * (ranks - 1) / ranks)


def fit_line(points: Sequence[Sequence[float]] | None) -> Line | None:
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


class StagedStates:
    """What every cost model prices alike from each stage's parameters: the model states a rank
    holds under ZeRO, and the update after a step's last micro-batch. A cost model mixing it in
    (``TableCostModel``, ``EncoderDecoderCostModel``) has ``stage_params(stage, tp)``, ``dtype`` and
    ``update`` (an ``UpdateCost``)."""

    def model_state_bytes(self, *, stage: Any = None, zero_stage: int = 0, dp: int = 1, tp: int = 1) -> ModelStateBytes:
        return zero_sharded_states(self.stage_params(stage, tp), Precision.of(self.dtype), zero_stage, dp)

    def update_ms(self, stages: Sequence[Any], *, zero_stage: int, dp: int, tp: int, link_gb_per_s: float) -> float:
        """After the last micro-batch: the gradient all-reduce over dp replicas and the optimizer
        step (on 1/dp of the parameters from ZeRO-1 on), of the slowest stage."""
        grad = Precision.of(self.dtype).grad

        def one(stage: Any) -> float:
            n = self.stage_params(stage, tp)
            return self.update.allreduce_ms(n * grad, dp, link_gb_per_s) + self.update.optimizer_ms(
                n / dp if zero_stage >= 1 else n
            )

        return max(one(s) for s in stages)
