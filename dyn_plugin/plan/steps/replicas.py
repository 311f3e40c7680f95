"""Scheduling replicas: micro-batches spread over the data-parallel replicas, and each replica's
pipeline schedule searched by simulation within memory, recompute then relaxed where it can be.
One path for a decoder-only model's sequences and an encoder-decoder's (input, target) pairs: the
pairs' planner passes how it prices a pair micro-batch in another recompute mode."""

from __future__ import annotations

from typing import Sequence

from .assign import assign_to_replicas
from .pricing import Reprice, recompute_to_fit, relax_recompute
from .pyramid import fewest_checkpointed
from .schedule import choose_schedule, one_f_one_b
from .simulator import simulate
from .spec import StepSpec
from .types import MicroBatch, ReplicaPlan, Schedule, SimResult, StepPlan
from .zero_bubble import split_backward


def replica_groups(micro_batches: Sequence[MicroBatch], dp: int, balance: bool, method: str) -> list[tuple]:
    """Each data-parallel replica's micro-batches: balanced by time, or round-robin in the given
    order as host frameworks hand a loader's micro-batches out; every replica needs one."""
    if balance:
        groups = assign_to_replicas([mb.time_ms for mb in micro_batches], dp)
    else:
        groups = [list(range(r, len(micro_batches), dp)) for r in range(dp)]
    if any(not g for g in groups):
        raise ValueError(f"{method}: a data-parallel replica got no micro-batch ({len(micro_batches)} for dp={dp})")
    return [tuple(micro_batches[i] for i in g) for g in groups]


def schedule_replicas(
    micro_batches: Sequence[MicroBatch],
    *,
    spec: StepSpec,
    method: str,
    balance: bool = True,
    adaptive: bool = True,
    reprice: Reprice | None = None,
    relax: bool = True,
) -> StepPlan:
    """Spread micro-batches over replicas (balanced, or round-robin as host frameworks do) and
    schedule each replica's pipeline (searched, or plain 1F1B in the given order); ``reprice`` and
    ``relax`` as ``schedule_replica`` takes them."""
    replicas = [
        schedule_replica(mbs, spec=spec, first=r, adaptive=adaptive, reprice=reprice, relax=relax)
        for r, mbs in enumerate(replica_groups(micro_batches, spec.dp, balance, method))
    ]
    return StepPlan(method, micro_batches[0].layout, tuple(replicas), spec.update_ms)


def _relaxed(
    mbs: tuple[MicroBatch, ...],
    schedule: Schedule,
    sim: SimResult,
    spec: StepSpec,
    reprice: Reprice | None,
    relax: bool,
) -> tuple[tuple[MicroBatch, ...], SimResult]:
    """``mbs`` on ``schedule`` with recompute relaxed where memory is spare (``relax``: by whole
    micro-batches, then with pyramid checkpointing by layers), and the simulation of the result."""
    if relax:
        mbs, sim = relax_recompute(mbs, schedule, sim, spec=spec, reprice=reprice)
    if spec.pyramid:
        mbs, sim = fewest_checkpointed(mbs, schedule, sim, spec)
    return mbs, sim


def schedule_replica(
    mbs: Sequence[MicroBatch],
    *,
    spec: StepSpec,
    first: int,
    size: int = 1,
    adaptive: bool = True,
    reprice: Reprice | None = None,
    relax: bool = True,
) -> ReplicaPlan:
    """One replica's pipeline: the schedule searched by simulation within the memory budget,
    then (``relax``) recompute relaxed where it leaves memory spare, by whole micro-batches
    (``reprice``: a micro-batch priced in another mode, default ``pricing.relax_recompute``'s)
    and then (pyramid checkpointing) by layers, then (``pipeline.schedule: zero_bubble``) the
    backwards split where that is faster; or plain 1F1B in the given order."""
    mbs = tuple(mbs)
    if adaptive:
        if not spec.cap_in_flight:  # the host keeps its 1F1B's warm-ups: fit the given order by recomputing
            mbs = recompute_to_fit(mbs, one_f_one_b(len(mbs), spec.pp), spec=spec)
        schedule, sim = choose_schedule(
            mbs,
            spec.link,
            memory_budget=[m.budget for m in spec.memory],
            seed=spec.seed,
            candidates=4,
            policy=spec.schedule,
            capped=spec.cap_in_flight,
        )
        chosen = mbs
        mbs, sim = _relaxed(chosen, schedule, sim, spec, reprice, relax)
        if spec.split_backward and spec.pp > 1:
            # split after recompute is relaxed (less recompute takes the spare memory first) and
            # before (the W's take it first): which pays depends on the step, so both are simulated
            budgets = [m.budget for m in spec.memory]
            tried = []
            if after := split_backward(mbs, schedule, spec.link, budgets):
                tried.append((mbs, *after))
            if before := split_backward(chosen, schedule, spec.link, budgets):
                relaxed, result = _relaxed(chosen, *before, spec, reprice, relax)
                tried.append((relaxed, before[0], result))
            for relaxed, split, result in tried:
                if result.makespan_ms < sim.makespan_ms * (1 - 1e-12):
                    mbs, schedule, sim = relaxed, split, result
    else:
        schedule = one_f_one_b(len(mbs), spec.pp)
        sim = simulate(mbs, schedule, spec.link)
    return ReplicaPlan(mbs, schedule, sim, first=first, size=size, tp=spec.tp)
