"""Pyramid checkpointing (DCP): per micro-batch and stage, the fewest layers under recompute that fit.

A micro-batch planned with recompute runs every layer of every stage under it. Where the
schedule leaves memory to spare, some of those layers can keep their activations instead, and
backward skips recomputing them. Two facts make the search cheap:

- with a replica's per-stage op order fixed, a stage's activation peak depends only on that
  stage's stored and peak bytes (``simulator.memory_steps``: a micro-batch's stored bytes live
  from its forward to its backward, the running op adds its transient), so each stage's memory
  is a set of per-op constraints, independent of timing and of the other stages;
- shortening ops never lengthens a fixed-order schedule (every start time is a max of sums of
  durations), so recomputing less never slows the step: no simulation is needed inside the
  search, only once at the end to price the result.

Per layer taken out of recompute a micro-batch saves the same time and costs the same bytes
(the tables are linear: ``evaluate_checkpointed`` prices a count), so micro-batches are lowered
in order of time saved per byte, each as far as the slack at every op where it is alive allows:
the fractional-knapsack rule, exact up to integrality for one constraint, a greedy for several.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from .pricing import checkpointed_layers, in_range, repriced
from .schedule import one_f_one_b
from .simulator import memory_steps, simulate
from .spec import PlannerSpec
from .types import MicroBatch, Schedule, SimResult

logger = logging.getLogger(__name__)

# Slack held back from every budget, so that the running sums kept here and the simulator's own
# sums (different rounding) agree on what fits.
MARGIN = 1e-9


def fewest_checkpointed(
    mbs: tuple[MicroBatch, ...], schedule: Schedule, sim: SimResult, spec: PlannerSpec
) -> tuple[tuple[MicroBatch, ...], SimResult]:
    """Each micro-batch with the fewest checkpointed layers per stage that keep every stage within
    its activation budget (``spec.memory``), on ``schedule`` as it is; the step is never slower.
    A stage already over its budget is never pushed further over.

    Fitted tables may price a layer's forward a little slower without recompute than with it
    (the same computation, measured twice): such a stage still gains (backward skips the
    recompute), so it is lowered where its forward and backward together get shorter, and the
    one simulation at the end confirms the step; should it not, only stages whose every op gets
    shorter are lowered, which cannot slow the step.
    """
    limits = [max(m.budget, p) for m, p in zip(spec.memory, sim.peak_bytes)]
    for strict in (False, True):
        current = _search(mbs, schedule, spec, strict)
        if all(a is b for a, b in zip(current, mbs)):
            return mbs, sim
        result = simulate(current, schedule, spec.link)
        if result.makespan_ms <= sim.makespan_ms and all(p <= l for p, l in zip(result.peak_bytes, limits)):
            return current, result
    # cannot happen by the argument above; if it does, the plan as it was stays valid
    logger.warning(
        "pyramid checkpointing left out: it would take the step from %.3f to %.3f ms or the peaks to %s, over %s",
        sim.makespan_ms,
        result.makespan_ms,
        result.peak_bytes,
        limits,
    )
    return mbs, sim


def fewest_checkpointed_alone(mb: MicroBatch, spec: PlannerSpec) -> MicroBatch:
    """``mb`` with the fewest checkpointed layers that fit each stage with nothing else in flight."""
    schedule = one_f_one_b(1, spec.pp)
    (alone,), _ = fewest_checkpointed((mb,), schedule, simulate([mb], schedule, spec.link), spec)
    return alone


def _search(mbs: tuple[MicroBatch, ...], schedule: Schedule, spec: PlannerSpec, strict: bool) -> tuple[MicroBatch, ...]:
    """The greedy: micro-batches by time saved per byte, each lowered on every stage as far as
    that stage's slack allows where it is alive; ``strict``: only where every op gets shorter."""
    budget = [m.budget * (1 - MARGIN) for m in spec.memory]
    stages = range(spec.pp)
    # Per stage: bytes while each op runs, and each micro-batch's forward and backward positions (a
    # split backward's I ends what checkpointing changes: W holds the linear layers' tensors alone).
    during = [np.array([d for d, _ in memory_steps(mbs, ops, s)]) for s, ops in enumerate(schedule.stages)]
    at = [{(op.kind.replace("I", "B"), op.mb): k for k, op in enumerate(ops)} for ops in schedule.stages]
    current = list(mbs)
    for _, i, bare, lowered in sorted(_candidates(current, spec, strict), key=lambda c: (-c[0], c[1])):
        mb = current[i]
        counts = list(checkpointed_layers(mb, spec))
        spans = [(at[s][("F", i)], at[s][("B", i)]) for s in stages]
        target = list(counts)
        for s in lowered:
            per_layer = (bare.stored_bytes[s] - mb.stored_bytes[s]) / counts[s]
            f, b = spans[s]
            # estimate: every op where it is alive gains per_layer bytes a layer, its transient unchanged
            slack = budget[s] - float(during[s][f : b + 1].max())
            drop = counts[s] if per_layer <= 0 else min(counts[s], max(0, math.floor(slack / per_layer)))
            target[s] = counts[s] - drop
        # the estimate ignores the transient's change: check each stage exactly and back off where it fails
        while target != counts:
            trial = repriced(mb, spec=spec, recompute=mb.recompute, checkpointed=target)
            over = [
                s for s in stages if target[s] != counts[s] and not _fits(during[s], spans[s], mb, trial, s, budget[s])
            ]
            if not over:
                for s in stages:
                    _apply(during[s], spans[s], mb, trial, s)
                current[i] = trial
                break
            for s in over:
                target[s] += 1
    return tuple(current)


def _candidates(
    mbs: list[MicroBatch], spec: PlannerSpec, strict: bool
) -> list[tuple[float, int, MicroBatch, list[int]]]:
    """(time saved per byte, index, the micro-batch with no layer checkpointed, the stages to lower)
    of every micro-batch that recomputes some layer and could recompute fewer in the measured range."""
    out = []
    for i, mb in enumerate(mbs):
        counts = list(checkpointed_layers(mb, spec))
        if mb.recompute == "none" or not any(counts):
            continue
        bare = repriced(mb, spec=spec, recompute=mb.recompute, checkpointed=[0] * spec.pp)
        if not in_range(bare, spec):
            continue
        lowered = [s for s in range(spec.pp) if counts[s] and _gains(mb, bare, s, strict)]
        saved = sum(mb.forward_ms[s] + mb.backward_ms[s] - bare.forward_ms[s] - bare.backward_ms[s] for s in lowered)
        cost = sum(bare.stored_bytes[s] - mb.stored_bytes[s] for s in lowered)
        if lowered:
            out.append((saved / cost if cost > 0 else math.inf, i, bare, lowered))
    return out


def _gains(mb: MicroBatch, bare: MicroBatch, s: int, strict: bool) -> bool:
    """Checkpointing fewer layers of stage s shortens its forward plus backward (``strict``: each
    of them). Costs are linear in the count, so comparing the ends decides for every count."""
    fwd, bwd = mb.forward_ms[s] - bare.forward_ms[s], mb.backward_ms[s] - bare.backward_ms[s]
    return (fwd >= 0 and bwd >= 0 and fwd + bwd > 0) if strict else fwd + bwd > 0


def _fits(during: np.ndarray, span: tuple[int, int], old: MicroBatch, new: MicroBatch, s: int, budget: float) -> bool:
    """Stage s with ``new`` in place of ``old``: no op where it is alive goes over the budget
    (or, already over it, higher than it was)."""
    f, b = span
    stored = new.stored_bytes[s] - old.stored_bytes[s]
    peak = new.peak_bytes[s] - old.peak_bytes[s]
    inner = during[f + 1 : b]
    ends = during[[f, b]]
    return bool(np.all(inner + stored <= np.maximum(budget, inner)) and np.all(ends + peak <= np.maximum(budget, ends)))


def _apply(during: np.ndarray, span: tuple[int, int], old: MicroBatch, new: MicroBatch, s: int) -> None:
    """Update stage s's bytes per op for ``new`` replacing ``old`` (memory_steps' accounting:
    its stored bytes between its ops, its peak while they run)."""
    f, b = span
    during[f + 1 : b] += new.stored_bytes[s] - old.stored_bytes[s]
    during[[f, b]] += new.peak_bytes[s] - old.peak_bytes[s]
