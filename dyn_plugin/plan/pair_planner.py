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

from typing import Sequence

from .assign import assign_to_replicas
from .pair_microbatch import partition_pairs, price_pair_groups
from .pair_spec import PairSpec
from .schedule import choose_schedule, one_f_one_b
from .simulator import simulate
from .types import PairMicroBatch, ReplicaPlan, StepPlan


def schedule_pair_replicas(
    micro_batches: Sequence[PairMicroBatch], *, spec: PairSpec, method: str, adaptive: bool = True
) -> StepPlan:
    """``adaptive``: micro-batches balanced over the replicas (equal counts) and each replica's
    schedule searched by simulation within memory; else round-robin in the given order and plain
    1F1B, as host frameworks run a loader's micro-batches."""
    if adaptive:
        groups = assign_to_replicas([mb.time_ms for mb in micro_batches], spec.dp)
    else:
        groups = [list(range(r, len(micro_batches), spec.dp)) for r in range(spec.dp)]
    replicas = []
    for r, g in enumerate(groups):
        mbs = tuple(micro_batches[i] for i in g)
        if not mbs:
            raise ValueError(
                f"{method}: a data-parallel replica got no micro-batch ({len(micro_batches)} for dp={spec.dp})"
            )
        if adaptive:
            schedule, sim = choose_schedule(
                mbs,
                spec.link,
                memory_budget=[m.budget for m in spec.memory],
                seed=spec.seed,
                candidates=4,
                policy=spec.schedule,
            )
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
    return schedule_pair_replicas(mbs, spec=spec, method="dynapipe")
