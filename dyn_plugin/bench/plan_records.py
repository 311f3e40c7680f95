"""What every planner benchmark records of a method's plans, sequences or pairs alike: each plan
timed as it is made, and the plans' simulated step, padding, peak memory, bubble and size."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np


def timed_plans(plan: Callable[[Any], Any], batches: Sequence[Any]) -> tuple[list, list[float]]:
    """``plan(batch)`` for each batch, and the milliseconds each took."""
    plans, times = [], []
    for batch in batches:
        t0 = time.perf_counter()
        plans.append(plan(batch))
        times.append((time.perf_counter() - t0) * 1e3)
    return plans, times


def schedule_counts(plans: Sequence[Any]) -> dict[str, int]:
    """How many of the plans' pipelines ran each schedule ("1f1b", "adaptive", "zero_bubble")."""
    names = [r.schedule.name for p in plans for r in p.replicas]
    return {name: names.count(name) for name in sorted(set(names))}


def plan_summary(plans: Sequence[Any], times: Sequence[float]) -> dict[str, Any]:
    """The record's fields every planner benchmark shares: planning time (p50, p99), and the plans'
    mean simulated step, padding, bubble and micro-batch count, their largest peak memory and the
    schedules their pipelines ran."""
    return {
        "schedules": schedule_counts(plans),
        "plan_ms_p50": float(np.percentile(times, 50)),
        "plan_ms_p99": float(np.percentile(times, 99)),
        "sim_iter_ms": float(np.mean([p.iteration_ms for p in plans])),
        "padding_fraction": float(np.mean([p.padding_fraction for p in plans])),
        "peak_mem_bytes": float(max(p.peak_bytes for p in plans)),
        "bubble": float(np.mean([p.bubble_fraction for p in plans])),
        "micro_batches": float(np.mean([len(p.micro_batches) for p in plans])),
    }
