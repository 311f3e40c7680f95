"""Bounds on a step no plan can beat, to measure plans against: the sequences' own work spread
perfectly over every device (``ideal_ms``), and the longest sequence's path through the
pipeline (``critical_path_ms``); and a plan's distance from the first, term by term (``gap_terms``)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...cost.model import features
from .pricing import make_micro_batch
from .pyramid import fewest_checkpointed_alone
from .spec import PlannerSpec
from .types import StepPlan


def ideal_ms(lengths: Sequence[int], spec: PlannerSpec) -> float:
    """The sequences' own work spread perfectly: per sequence its token and attention cost over
    the whole model (no padding, no recompute, no fixed per-micro-batch cost), over pp*dp devices,
    plus the update every plan pays."""
    table = spec.cost.table("packed", "none", spec.tp)
    arr = np.asarray(lengths, dtype=float)
    total = 0.0
    counts = {"embedding": 1, "layer": spec.cost.num_layers, "head": 1}
    for comp, k in counts.items():
        for metric in ("forward_ms", "backward_ms"):
            _, c1, c2 = table.fits[comp][metric].coef
            total += k * float(np.sum(c1 * arr + c2 * arr * arr))
    return total / (spec.pp * spec.dp) + spec.update_ms


def critical_path_ms(lengths: Sequence[int], spec: PlannerSpec) -> float:
    """A lower bound no plan can beat: the longest sequence alone, in the cheapest recompute mode
    and group size it fits in (with pyramid checkpointing: on the fewest layers it fits with), must
    still pass forward through every stage and backward through every stage, and the update follows."""
    longest = int(max(lengths))
    best = float("inf")
    for layout, rc, sp in ((l, r, k) for l in spec.layouts for r in spec.recomputes for k in spec.sp_sizes):
        mb = make_micro_batch([0], [longest], spec=spec, layout=layout, recompute=rc, sp=sp)
        if all(p <= m.budget for p, m in zip(mb.peak_bytes, spec.memory)):
            if spec.pyramid:  # alone, it may keep some layers' activations
                mb = fewest_checkpointed_alone(mb, spec)
            hops = 2 * (spec.pp - 1) * spec.link.transfer_ms(mb.activation_bytes)
            best = min(best, sum(mb.forward_ms) + sum(mb.backward_ms) + hops)
    return best + spec.update_ms


def gap_terms(plan: StepPlan, lengths: Sequence[int], spec: PlannerSpec) -> dict[str, float]:
    """Where a plan's step goes beyond ``ideal_ms``, term by term, in ms of the step (the terms
    add up to ``plan.iteration_ms - ideal_ms``): the GPU-time each costs, spread over every GPU.

    - ``recompute``: the micro-batches' time over the same micro-batches priced without recompute
      (collectives re-run in backward included);
    - ``communication``: sequence parallelism's attention collectives (without recompute);
    - ``fixed``: the rest of the busy time above the sequences' own work: per-micro-batch constants,
      padding, kernels on their floors;
    - ``bubble``: idle time inside each pipeline (fill, drain, waits);
    - ``imbalance``: pipelines idle after they drain while the slowest still runs."""
    devices = spec.pp * spec.dp
    work = (ideal_ms(lengths, spec) - spec.update_ms) * devices
    slowest = max(r.sim.makespan_ms for r in plan.replicas)
    busy = recompute = comm = bubble = imbalance = 0.0
    for rep in plan.replicas:
        ranks = rep.size * len(rep.schedule.stages)
        mine = 0.0
        for mb in rep.micro_batches:
            plain = make_micro_batch(
                range(len(mb.seq_lens)), mb.seq_lens, spec=spec, layout=mb.layout, recompute="none", sp=mb.sp
            )
            mine += sum(mb.forward_ms) + sum(mb.backward_ms)
            recompute += rep.size * (
                sum(mb.forward_ms) + sum(mb.backward_ms) - sum(plain.forward_ms) - sum(plain.backward_ms)
            )
            if mb.sp > 1:
                f = features(mb.seq_lens, mb.layout, spec.cost.pad_multiple, mb.sp)
                c = spec.layer_comm(mb.sp, "none")
                comm += (
                    rep.size * sum(s.num_layers for s in spec.stages) * (c.forward_ms(f.slots) + c.backward_ms(f.slots))
                )
        busy += rep.size * mine
        bubble += ranks * rep.sim.makespan_ms - rep.size * mine
        imbalance += ranks * (slowest - rep.sim.makespan_ms)
    fixed = busy - work - recompute - comm
    return {
        k: v / devices
        for k, v in (
            ("recompute", recompute),
            ("communication", comm),
            ("fixed", fixed),
            ("bubble", bubble),
            ("imbalance", imbalance),
        )
    }
