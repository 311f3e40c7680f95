"""Hydraulis's two-stage assignment of one step's sequences to a strategy's pipelines.

Stage 1 (``plan/assignment/dispatch.py``) sends every sequence to one pipeline, balancing their estimated
finish times; stage 2 cuts each pipeline's sequences into micro-batches: DynaPipe's DP
(``plan/steps/microbatch.py``) by default, or the ILP (``plan/assignment/microbatch_ilp.py``), kept for a
pipeline only where it simulates faster than the DP's cut. Each pipeline is then scheduled and
simulated as any replica is (``replicas.schedule_replica``), so a step under a strategy is an
ordinary ``StepPlan``: where the pipelines differ in sequence-parallel size only, it runs for real;
mixed tensor or pipeline degrees are simulated only (``execution_plans`` refuses them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from ...cost.model import Layout
from ..steps.assign import split_for_replicas
from ..steps.microbatch import InfeasibleError, partition
from ..steps.pricing import cheapest_feasible, make_micro_batch
from ..steps.replicas import schedule_replica
from ..steps.spec import PlannerSpec
from ..steps.types import MicroBatch, ReplicaPlan, StepPlan

Stage2 = Literal["dp", "ilp"]


@dataclass(frozen=True)
class Pipeline:
    """One pipeline of a strategy: its planner spec (one pipeline: dp = 1, its tp and stages), the
    sequence-parallel size it prices micro-batches at, and its first data-parallel column."""

    spec: PlannerSpec
    sp: int = 1
    first: int = 0


@dataclass(frozen=True)
class Stage2Options:
    """How stage 2 cuts a pipeline's sequences: the DP, or the ILP within deterministic limits
    (``node_limit``) and, where plans are shared through a store, a wall-clock budget."""

    method: Stage2 = "dp"
    node_limit: int | None = None
    time_limit_s: float | None = None


def plan_members(
    lens: np.ndarray,
    members: Sequence[Sequence[int]],
    pipelines: Sequence[Pipeline],
    layout: Layout,
    *,
    method: str,
    stage2: Stage2Options = Stage2Options(),
    native: bool = True,
    equal_counts: bool = False,
) -> StepPlan | None:
    """Stage 2 for sequences already placed: each pipeline's ``members`` cut into micro-batches,
    scheduled and simulated; None when some pipeline's sequences cannot be cut within its memory
    or (``equal_counts``) split into as many micro-batches as the most any pipeline runs."""
    per_pipeline = []
    for pipe, ids in zip(pipelines, members):
        mbs = cut(lens, list(ids), pipe, layout, native=native)
        if mbs is None:
            return None
        per_pipeline.append(mbs)
    if equal_counts:
        per_pipeline = equalize_counts(per_pipeline, lens, [p.spec for p in pipelines])
        if per_pipeline is None:
            return None
    replicas = tuple(
        scheduled(mbs, pipe, lens, stage2, keep_count=equal_counts) for mbs, pipe in zip(per_pipeline, pipelines)
    )
    return StepPlan(method, layout, replicas, max(p.spec.update_ms for p in pipelines))


def cut(
    lens: np.ndarray, ids: Sequence[int], pipe: Pipeline, layout: Layout, *, native: bool = True
) -> list[MicroBatch] | None:
    """Stage 2's DP for one pipeline: DynaPipe's partition of its sequences at its size, priced
    on its stages (None when they cannot be cut within its memory)."""
    spec, k = pipe.spec, pipe.sp
    try:
        part = partition(
            lens[list(ids)],
            spec.cost,
            layout=layout,
            stages=spec.stages,
            memory=spec.memory,
            dp=1,
            recomputes=spec.recomputes,
            tp=spec.tp,
            native=native,
            sp=k,
            comm=[spec.layer_comm(k, rc) for rc in spec.recomputes],
        )
    except InfeasibleError:
        return None
    return [
        make_micro_batch([ids[j] for j in part.order[a:b]], lens, spec=spec, layout=layout, recompute=rc, sp=k)
        for a, b, rc in zip(part.bounds, part.bounds[1:], part.recompute)
    ]


def scheduled(
    mbs: list[MicroBatch], pipe: Pipeline, lens: np.ndarray, stage2: Stage2Options, *, keep_count: bool = False
) -> ReplicaPlan:
    """The pipeline's schedule for the DP's cut, or for the ILP's where that simulates faster
    (``keep_count``: and runs as many micro-batches, as equal counts across pipelines need)."""
    rep = schedule_replica(mbs, spec=pipe.spec, first=pipe.first, size=pipe.sp)
    if stage2.method != "ilp":
        return rep
    from .microbatch_ilp import ilp_partition  # HiGHS is loaded only where the ILP is asked for

    ids = [i for mb in mbs for i in mb.sample_ids]
    at = {i: j for j, i in enumerate(ids)}
    local = [[at[i] for i in mb.sample_ids] for mb in mbs]
    spec = pipe.spec
    limits = {"node_limit": stage2.node_limit} if stage2.node_limit is not None else {}
    res = ilp_partition(
        [int(lens[i]) for i in ids],
        spec,
        incumbent=local,
        time_limit_s=stage2.time_limit_s,
        counts=[len(mbs)] if keep_count else None,
        **limits,
    )
    if sorted(map(sorted, res.groups)) == sorted(map(sorted, local)):
        return rep
    ilp = [
        make_micro_batch([ids[j] for j in g], lens, spec=spec, layout=mbs[0].layout, recompute=rc, sp=pipe.sp)
        for g, rc in zip(res.groups, res.recompute)
    ]
    alt = schedule_replica(ilp, spec=spec, first=pipe.first, size=pipe.sp)
    return alt if alt.sim.makespan_ms < rep.sim.makespan_ms else rep


def equalize_counts(
    per_pipeline: list[list[MicroBatch]], lens: np.ndarray, specs: Sequence[PlannerSpec]
) -> list[list[MicroBatch]] | None:
    """Split micro-batches (``split_for_replicas``: the most tokens first, alternate members) in
    pipelines with fewer until every pipeline runs as many as the most, as ZeRO-2/3 need; each
    half priced on its own pipeline's spec. None when a pipeline runs out of sequences to split."""
    target = max(len(g) for g in per_pipeline)
    out = []
    for mbs, spec in zip(per_pipeline, specs):
        try:
            ids = split_for_replicas([list(mb.sample_ids) for mb in mbs], lens, target, equal_counts=False)
        except ValueError:
            return None
        kept = {mb.sample_ids: mb for mb in mbs}
        halves = [g for g in ids if tuple(g) not in kept]
        priced = cheapest_feasible(halves, lens, spec=spec, layout=mbs[0].layout, sp=mbs[0].sp) if halves else []
        if priced is None:
            return None
        out.append([kept[tuple(g)] for g in ids if tuple(g) in kept] + priced)
    return out
