"""What cutting a pipeline's long sequences into token slices would give: a simulation, not a plan.

A long sequence alone can set a step's length: its forward must cross every stage before its
backward can start, so its critical path (``bounds.critical_path_ms``) is the step's floor, above
the ideal at 64k tokens a step (A100 GPT-6.7B, code, pp = 4). Cut into k slices of its tokens that
enter the pipeline one after another (TeraPipe's token-level pipelining), each slice crosses a
stage in about 1/k of the time, so the fill and the drain shrink by that much. Slice j attends
causally to its own tokens and to the keys and values of the slices before it, which stay on the
stage until their backwards: so each stage runs the forwards in slice order and the backwards in
the reverse order (slice j's backward returns the gradients of the earlier slices' keys and values).

Plans at 64k tokens a step hold few micro-batches, most of them one long sequence each (the
planner packs up to what memory allows), so each replica's sequences of at least ``LONG`` tokens
are cut alike. ``sliced_replica`` prices the slices from the cost tables (slice j of length l after p tokens:
``l`` token slots and the attention pairs of ``l`` queries over ``p + l`` keys, ``2lp + l^2`` in
the tables' ``sum(s^2)`` count, so the slices' pairs add up to the whole sequence's), expands the
sequences' ops in the replica's own schedule and in plain 1F1B of its order into the slices'
(forwards in order, backwards reversed: the order every stage runs them, so no other dependency is
needed), splits the backwards for a zero-bubble schedule where the micro-batches are priced for it
(or moves the W's of a split schedule into the new waits), and keeps the fastest within memory. What it leaves out, for a build to settle: the earlier slices' keys and
values held again by each later slice's attention where a kernel needs them in one tensor, and the
executor (no host runs slices yet: the planner does not make them, ``dynplugin bench planner``
reports this what-if beside the plans).
"""

from __future__ import annotations

from typing import Sequence

from ...cost.model import Features
from .pricing import price_features
from .schedule import one_f_one_b
from .simulator import simulate, stage_peak_bytes
from .spec import PlannerSpec
from .types import MicroBatch, Op, ReplicaPlan, Schedule, SimResult, StepPlan
from .zero_bubble import fill_waits, split_backward

SLICES = (2, 4, 8)  # slice counts tried (every long sequence of a replica cut alike)
LONG = 2048  # tokens from which a micro-batch of one sequence is cut


def slice_costs(mb: MicroBatch, k: int, spec: PlannerSpec) -> tuple[MicroBatch, ...]:
    """``mb`` (one sequence, not split over a sequence-parallel group) as ``k`` slices of its tokens,
    each priced on every stage in ``mb``'s recompute mode (and pyramid counts)."""
    if len(mb.seq_lens) != 1 or mb.sp != 1:
        raise ValueError("only a micro-batch of one sequence, on one rank a stage, is cut into slices")
    length = mb.seq_lens[0]
    bounds = [length * j // k for j in range(k + 1)]
    out = []
    for j in range(k):
        before, own = bounds[j], bounds[j + 1] - bounds[j]
        f = Features(slots=float(own), attn=float(2 * own * before + own * own), max_len=before + own)
        out.append(
            price_features(
                mb.sample_ids,
                (own,),
                f,
                (1, own),
                spec=spec,
                layout=mb.layout,
                recompute=mb.recompute,
                checkpointed=mb.checkpointed or None,
            )
        )
    return tuple(out)


def _expanded(schedule: Schedule, parts: Sequence[int]) -> Schedule:
    """``schedule`` with micro-batch i replaced by its ``parts[i]`` slices, numbered in order after
    the micro-batches before it (forwards in slice order, backwards reversed)."""
    starts = [sum(parts[:i]) for i in range(len(parts))]

    def ops(op: Op) -> list[Op]:
        slices = range(starts[op.mb], starts[op.mb] + parts[op.mb])
        return [Op(op.kind, j) for j in (slices if op.kind == "F" else reversed(slices))]  # B, I, W reversed

    stages = tuple(tuple(x for op in stage for x in ops(op)) for stage in schedule.stages)
    order = tuple(j for i in schedule.order for j in range(starts[i], starts[i] + parts[i]))
    return Schedule(name=f"{schedule.name}_sliced", order=order, stages=stages)


def sliced_replica(replica: ReplicaPlan, spec: PlannerSpec) -> tuple[SimResult, int]:
    """(the fastest simulation, its slice count) of ``replica`` with every micro-batch of one long
    sequence (at least ``LONG`` tokens) cut into that many slices, within every stage's memory;
    (the replica's own, 1) where no cut is faster or fits."""
    best, slices = replica.sim, 1
    mbs = list(replica.micro_batches)
    long = [len(mb.seq_lens) == 1 and mb.sp == 1 and mb.seq_lens[0] >= LONG for mb in mbs]
    if not any(long) or spec.pp == 1:
        return best, slices
    # the replica's own schedule (its order, caps and split) and plain 1F1B in its order, each
    # with the long sequences' ops expanded into their slices'
    bases = [replica.schedule, one_f_one_b(len(mbs), spec.pp, order=replica.schedule.order)]
    budgets = [m.budget for m in spec.memory]
    for k in SLICES:
        parts = [k if cut else 1 for cut in long]
        priced = [s for mb, cut in zip(mbs, long) for s in (slice_costs(mb, k, spec) if cut else (mb,))]
        for base in bases:
            schedule = _expanded(base, parts)
            if any(stage_peak_bytes(priced, ops, s) > budgets[s] for s, ops in enumerate(schedule.stages)):
                continue
            split = any(op.kind == "W" for stage in schedule.stages for op in stage)
            if split:  # the W's moved into the waits the slices leave
                candidates = [fill_waits(priced, schedule, spec.link)[1]]
            else:
                candidates = [simulate(priced, schedule, spec.link)]
                if spec.split_backward and (whole := split_backward(priced, schedule, spec.link, budgets)):
                    candidates.append(whole[1])
            for sim in candidates:
                if sim.makespan_ms < best.makespan_ms:
                    best, slices = sim, k
    return best, slices


def sliced_step_ms(plan: StepPlan, spec: PlannerSpec) -> tuple[float, Sequence[int]]:
    """The step ``plan`` would take with each replica's long sequences cut where that is faster, and
    the slice count each replica kept (1: none)."""
    results = [sliced_replica(r, spec) for r in plan.replicas]
    return max(sim.makespan_ms for sim, _ in results) + plan.update_ms, [k for _, k in results]
