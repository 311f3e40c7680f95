"""The encoder-decoder planner: a global batch of (input, target) pairs in, a step plan out.

``plan_pairs`` partitions the pairs by DynaPipe's DP (pair_microbatch.py), spreads the
micro-batches over the data-parallel replicas with equal counts, balanced by time (assign.py),
and picks each replica's schedule by simulation within every stage's memory (schedule.py), as
``plan_step`` does for decoder-only models; baselines (pair_baselines.py) go through the same
pricing and simulation. The simulator takes each micro-batch's bytes per link: encoder stages
send hidden states of the input side, decoder stages those of the target side and the encoder
output they carry.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ...cost.model import RECOMPUTES
from .pair_microbatch import partition_pairs, price_pair_groups
from .pair_spec import PairSpec
from .pricing import relax_recompute
from .replicas import replica_groups
from .schedule import choose_schedule, one_f_one_b
from .simulator import simulate
from .types import PairMicroBatch, ReplicaPlan, StepPlan


def schedule_pair_replicas(
    micro_batches: Sequence[PairMicroBatch],
    *,
    spec: PairSpec,
    method: str,
    adaptive: bool = True,
    pairs: tuple[Sequence[int], Sequence[int]] | None = None,
) -> StepPlan:
    """``adaptive``: micro-batches balanced over the replicas (equal counts), each replica's
    schedule searched by simulation within memory, then (given the global batch's ``pairs``)
    recompute relaxed where the schedule leaves memory spare (``pricing.relax_recompute``: the
    DP priced each micro-batch as if all in flight with it were as big); else round-robin in the
    given order and plain 1F1B, as host frameworks run a loader's micro-batches."""
    replicas = []
    for r, mbs in enumerate(replica_groups(micro_batches, spec.dp, adaptive, method)):
        if adaptive:
            schedule, sim = choose_schedule(
                mbs,
                spec.link,
                memory_budget=[m.budget for m in spec.memory],
                seed=spec.seed,
                candidates=4,
                policy=spec.schedule,
            )
            if pairs is not None:
                mbs, sim = relax_recompute(mbs, schedule, sim, spec=spec, reprice=_repricer(*pairs, spec))
        else:
            schedule = one_f_one_b(len(mbs), spec.pp)
            sim = simulate(mbs, schedule, spec.link)
        replicas.append(ReplicaPlan(mbs, schedule, sim, first=r, size=1, tp=spec.tp))
    return StepPlan(method, "padded", tuple(replicas), spec.update_ms)


def plan_pairs(inputs: Sequence[int], targets: Sequence[int], spec: PairSpec) -> StepPlan:
    """The plugin's plan of one global batch of pairs (``inputs[i]``, ``targets[i]``): sample ids
    in its micro-batches index these sequences."""
    part = partition_pairs(inputs, targets, spec)
    mbs = price_pair_groups(part.groups(), inputs, targets, part.recompute, spec=spec)
    plan = schedule_pair_replicas(mbs, spec=spec, method="dynapipe", pairs=(inputs, targets))
    return same_pair_recompute(plan, inputs, targets, spec=spec)


def _repricer(inputs: Sequence[int], targets: Sequence[int], spec: PairSpec):
    """A pair micro-batch priced in another recompute mode; None out of the measured range."""

    def reprice(old: PairMicroBatch, rc: str) -> PairMicroBatch | None:
        mb = price_pair_groups([old.sample_ids], inputs, targets, [rc], spec=spec)[0]
        return None if mb.extrapolated else mb

    return reprice


def same_pair_recompute(plan: StepPlan, inputs: Sequence[int], targets: Sequence[int], *, spec: PairSpec) -> StepPlan:
    """With ``spec.same_recompute`` (ZeRO-3), every replica's i-th micro-batch in run order takes the
    strongest recompute mode among them, as ``pricing.same_recompute`` does for decoder-only plans:
    ZeRO-3 gathers parameters in the order modules run, and recompute re-runs them in backward.
    Memory only falls; the schedules stay and the replicas are simulated again."""
    if not spec.same_recompute or len(plan.replicas) < 2:
        return plan
    orders = [r.schedule.order for r in plan.replicas]
    new = [list(r.micro_batches) for r in plan.replicas]
    for pos in range(len(orders[0])):
        mbs = [r.micro_batches[o[pos]] for r, o in zip(plan.replicas, orders)]
        mode = max((mb.recompute for mb in mbs), key=RECOMPUTES.index)
        for r, (mb, o) in enumerate(zip(mbs, orders)):
            if mb.recompute != mode:
                new[r][o[pos]] = price_pair_groups([mb.sample_ids], inputs, targets, [mode], spec=spec)[0]
    replicas = tuple(
        replace(r, micro_batches=tuple(m), sim=simulate(m, r.schedule, spec.link)) for r, m in zip(plan.replicas, new)
    )
    return replace(plan, replicas=replicas)
