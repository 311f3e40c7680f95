"""The encoder-decoder planner: a global batch of (input, target) pairs in, a step plan out.

``plan_pairs`` partitions the pairs by DynaPipe's DP (pair_microbatch.py), then schedules the
replicas and evens recompute out under ZeRO-3 as ``plan_step`` does for decoder-only models, on
the same path (``replicas.schedule_replicas``, ``pricing.same_recompute``), with how a pair
micro-batch is priced in another recompute mode; baselines (pair_baselines.py) go through the same
pricing and simulation. The simulator takes each micro-batch's bytes per link: encoder stages
send hidden states of the input side, decoder stages those of the target side and the encoder
output they carry.
"""

from __future__ import annotations

from typing import Sequence

from .pair_microbatch import partition_pairs, price_pair_groups
from .pair_spec import PairSpec
from .pricing import same_recompute
from .replicas import schedule_replicas
from .types import PairMicroBatch, StepPlan


def plan_pairs(inputs: Sequence[int], targets: Sequence[int], spec: PairSpec) -> StepPlan:
    """The plugin's plan of one global batch of pairs (``inputs[i]``, ``targets[i]``): sample ids
    in its micro-batches index these sequences."""
    part = partition_pairs(inputs, targets, spec)
    mbs = price_pair_groups(part.groups(), inputs, targets, part.recompute, spec=spec)
    plan = schedule_replicas(mbs, spec=spec, method="dynapipe", reprice=_repricer(inputs, targets, spec))
    return same_recompute(plan, spec=spec, remake=_remaker(inputs, targets, spec))


def _repricer(inputs: Sequence[int], targets: Sequence[int], spec: PairSpec):
    """A pair micro-batch priced in another recompute mode; None out of the measured range."""

    def reprice(old: PairMicroBatch, rc: str) -> PairMicroBatch | None:
        mb = price_pair_groups([old.sample_ids], inputs, targets, [rc], spec=spec)[0]
        return None if mb.extrapolated else mb

    return reprice


def _remaker(inputs: Sequence[int], targets: Sequence[int], spec: PairSpec):
    """A pair micro-batch priced in another recompute mode (pairs have no per-layer checkpointing)."""

    def remake(old: PairMicroBatch, rc: str, checkpointed: list[int] | None) -> PairMicroBatch:
        return price_pair_groups([old.sample_ids], inputs, targets, [rc], spec=spec)[0]

    return remake
