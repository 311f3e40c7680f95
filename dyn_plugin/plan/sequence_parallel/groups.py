"""DCP's dynamic sequence parallelism: per step, aligned groups of data-parallel columns and the
sequences each group runs.

A group of k neighbouring columns runs its own pipeline with every row split over its k ranks: a
long sequence that fits no single device, or would hold a pipeline up alone, runs on k ranks in
about 1/k of the time plus the attention collectives, while short sequences keep running unsplit
in groups of one, where they pay no collectives. Per step:

1. the smallest group size each sequence fits in: memory only grows with length, so one
   threshold length per (size, recompute mode);
2. groupings: multisets of allowed sizes summing to the column count, laid out largest first so
   every group starts at a multiple of its size (the process groups are aligned blocks), each
   with a group big enough for the longest sequence;
3. every grouping is priced by a fluid estimate, the best few by dispatch: sequences longest
   first onto the group where they would finish earliest (their time at the group's size, plus
   the group's pipeline fill and drain by its longest sequence); groups may end up with
   different amounts of work and micro-batch counts (DCP's inter balancing) unless every rank
   must run the same count (ZeRO-2/3, or ``balance = intra``);
4. the best of those, and every grouping of one size, are planned for real: DynaPipe's DP cuts
   each group's sequences into micro-batches priced at the group's size, each group's schedule
   is searched and simulated, and the plan with the shortest simulated step wins.

DynaPipe's plan (every group one column wide) is one candidate of ``plan_step``, so turning
sequence parallelism on never plans a slower step than leaving it off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...cost.model import Layout
from ..assignment.dispatch import dispatch as stage1
from ..assignment.two_stage import Pipeline, plan_members
from ..steps.microbatch import InfeasibleError
from ..steps.pricing import make_micro_batch, usable
from ..steps.spec import PlannerSpec
from ..steps.types import StepPlan

ESTIMATED = 8  # groupings dispatched after the fluid estimate
PLANNED = 3  # groupings planned and simulated in full


@dataclass(frozen=True)
class SizeLimits:
    """Per (group size, recompute mode), the longest of the batch's sequences that fits alone
    (0: none does); found once per layout, read by the size choice and the per-sequence times."""

    sizes: tuple[int, ...]
    by_mode: dict[tuple[int, str], int]

    @property
    def longest(self) -> dict[int, int]:
        """Per group size, the longest sequence that fits alone in some recompute mode."""
        return {k: max(v for (size, _), v in self.by_mode.items() if size == k) for k in self.sizes}

    def smallest(self, length: int) -> int | None:
        longest = self.longest
        return next((k for k in self.sizes if length <= longest[k]), None)


def groupings(columns: int, sizes: Sequence[int], need: int) -> list[tuple[int, ...]]:
    """Non-increasing tuples of ``sizes`` summing to ``columns`` whose largest is >= ``need``."""
    allowed = sorted((k for k in sizes if k <= columns), reverse=True)
    out: list[tuple[int, ...]] = []

    def extend(prefix: list[int], left: int, cap: int) -> None:
        if left == 0:
            out.append(tuple(prefix))
            return
        for k in allowed:
            if k <= cap and k <= left:
                extend(prefix + [k], left - k, k)

    extend([], columns, columns)
    return [g for g in out if g[0] >= need]


def aligned_firsts(grouping: Sequence[int]) -> list[int]:
    """First column of each group, laid out in order; refuses a grouping that breaks alignment."""
    firsts, col = [], 0
    for k in grouping:
        if col % k:
            raise ValueError(
                f"grouping {tuple(grouping)}: a group of {k} would start at column {col}; groups start at "
                "a multiple of their size (list larger groups first, or pair groups of one)"
            )
        firsts.append(col)
        col += k
    return firsts


def size_limits(lengths: np.ndarray, spec: PlannerSpec, layout: Layout) -> SizeLimits:
    """Per group size and recompute mode, the longest of the batch's sequences that fits alone."""
    return SizeLimits(
        tuple(spec.sp_sizes),
        {(k, rc): _longest_alone(lengths, k, rc, spec, layout) for k in spec.sp_sizes for rc in spec.recomputes},
    )


def sequence_ms(lengths: np.ndarray, k: int, spec: PlannerSpec, layout: Layout, limits: SizeLimits) -> np.ndarray:
    """Per sequence, the slowest stage's forward + backward at group size ``k`` in the cheapest
    recompute mode it fits in alone (inf where none), fixed per-micro-batch costs left out:
    sequences share them. ``limits``: ``size_limits`` of a batch holding ``lengths``."""
    out = np.full(len(lengths), np.inf)
    for rc in spec.recomputes:
        todo = (lengths <= limits.by_mode[(k, rc)]) & np.isinf(out)
        if todo.any():
            out[todo] = _marginal_ms(lengths[todo], k, rc, spec, layout)
    return out


def _longest_alone(lengths: np.ndarray, k: int, rc: str, spec: PlannerSpec, layout: Layout) -> int:
    """Binary search over the batch's distinct lengths (memory grows with length); 0 if none fits."""
    distinct = np.unique(lengths)
    lo, hi = -1, len(distinct) - 1  # distinct[lo] fits (or lo = -1); nothing beyond hi does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if usable(make_micro_batch([0], [int(distinct[mid])], spec=spec, layout=layout, recompute=rc, sp=k), spec):
            lo = mid
        else:
            hi = mid - 1
    return int(distinct[lo]) if lo >= 0 else 0


def _marginal_ms(lengths: np.ndarray, k: int, rc: str, spec: PlannerSpec, layout: Layout) -> np.ndarray:
    """Vectorised over sequences: the linear terms of the cost table (and of the collectives) at
    the per-rank slots and attention of a sequence split over ``k`` ranks."""
    table = spec.cost.table(layout, rc, spec.tp)
    width = -(-lengths // k) * k
    slots = width / k
    attn = (lengths.astype(float) ** 2 + (width - lengths).astype(float) ** 2) / k
    comm, rerun = spec.layer_comm(k, "none"), spec.layer_comm(k, rc)
    worst = np.zeros(len(lengths))
    for stage in spec.stages:
        counts = {"embedding": int(stage.first), "layer": stage.num_layers, "head": int(stage.last)}
        t = np.zeros(len(lengths))
        for comp, n in counts.items():
            for metric in ("forward_ms", "backward_ms"):
                _, c1, c2 = table.fits[comp][metric].coef
                t += n * (c1 * slots + c2 * attn)
        t += stage.num_layers * (comm.forward[1] + rerun.backward[1]) * slots
        worst = np.maximum(worst, t)
    return worst


def dispatch(
    lengths: np.ndarray, grouping: Sequence[int], times: dict[int, np.ndarray], pp: int, *, native: bool = True
) -> tuple[float, list[list[int]]] | None:
    """Stage 1 (``plan.dispatch``) with the groups as pipelines, one kind per group size:
    longest first, each sequence onto the group where it would finish earliest (the group's work
    so far, its time there, and (pp - 1) times the group's longest sequence for the pipeline's
    fill and drain). (makespan, members per group), or None when some group gets no sequence or
    one fits nowhere. Longest first only, without stage 1's random orders and local improvement:
    here the result only ranks groupings before each is planned in full, and on the test batches
    the improvement moved the planned step by under 1e-5 (relative) while it can move a group's
    only sequence away."""
    sizes = sorted(set(grouping))
    table = np.stack([times[k] for k in sizes])
    try:
        got = stage1(
            table,
            [sizes.index(k) for k in grouping],
            [pp - 1.0] * len(sizes),
            lengths,
            improve=False,
            native=native,
            trials=0,
        )
    except InfeasibleError:
        return None
    if any(not m for m in got.members):
        return None
    return got.makespan_ms, [list(m) for m in got.members]


def fluid_ms(grouping: Sequence[int], times: dict[int, np.ndarray], pp: int) -> float:
    """A quick lower-bound-like price: each sequence on the smallest group size present that it
    fits in, its rank-time (k ranks busy) spread over all columns, or the longest sequence's own
    pipeline pass, whichever is longer."""
    present = sorted(set(grouping))
    best = np.full(len(times[present[0]]), np.inf)
    for k in present:
        best = np.where(np.isinf(best), times[k] * k, best)
    if np.isinf(best).any():
        return math.inf
    largest = times[present[-1]]
    return max(float(best.sum()) / sum(grouping), pp * float(largest.max()))


def plan_groups(
    lengths: Sequence[int], spec: PlannerSpec, *, native: bool = True, grouping: Sequence[int] | None = None
) -> StepPlan:
    """The fastest step over groupings of the columns (or the one ``grouping`` given, sizes in
    column order). Raises InfeasibleError when no grouping can run the batch."""
    lens = np.asarray(lengths, dtype=np.int64)
    best = None
    for layout in spec.layouts:
        limits = size_limits(lens, spec, layout)
        need = limits.smallest(int(lens.max()))
        if need is None:
            continue
        if grouping is not None:
            aligned_firsts(grouping)
            candidates = [tuple(grouping)]
        else:
            candidates = groupings(spec.dp, spec.sp_sizes, need)
        times = {k: sequence_ms(lens, k, spec, layout, limits) for k in set(k for g in candidates for k in g)}
        ranked = sorted(candidates, key=lambda g: fluid_ms(g, times, spec.pp))[:ESTIMATED]
        # one size for every group is planned whatever the estimates say: a fixed size is never better
        uniform = [g for g in candidates if len(set(g)) == 1 and g not in ranked]
        dispatched = [
            d
            for d in ((g, dispatch(lens, g, times, spec.pp, native=native)) for g in ranked + uniform)
            if d[1] is not None
        ]
        dispatched.sort(key=lambda d: d[1][0])
        chosen = dispatched[:PLANNED] + [d for d in dispatched[PLANNED:] if len(set(d[0])) == 1]
        for g, (_, members) in chosen:
            plan = _plan_grouping(lens, g, members, spec, layout, native)
            if plan is not None and (best is None or plan.iteration_ms < best.iteration_ms):
                best = plan
    if best is None:
        what = f"grouping {tuple(grouping)}" if grouping is not None else f"any grouping of sizes {spec.sp_sizes}"
        raise InfeasibleError(
            f"no plan runs this batch (longest sequence {int(lens.max())}) with {what} over "
            f"{spec.dp} columns: it fits in no group, or a group gets no sequence; allow larger "
            "sequence_parallel.sizes, raise the memory, or cap microbatching.max_seq_len"
        )
    return best


def _plan_grouping(
    lens: np.ndarray, grouping: Sequence[int], members: list[list[int]], spec: PlannerSpec, layout: Layout, native: bool
) -> StepPlan | None:
    """DynaPipe's DP within each group at its size; equal counts enforced by splitting micro-batches."""
    pipelines = [Pipeline(spec, k, first) for k, first in zip(grouping, aligned_firsts(grouping))]
    return plan_members(
        lens, members, pipelines, layout, method="dynamic_sp", native=native, equal_counts=spec.equal_counts
    )
