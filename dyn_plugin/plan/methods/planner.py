"""The planner: a global batch of sequence lengths in, the fastest step plan out.

Orchestration only: the spec is spec.py, micro-batch pricing pricing.py, replica scheduling
replicas.py, the plan types types.py, the ideal and critical-path bounds bounds.py.

plan_step runs the DynaPipe partition (microbatch.py) for each allowed layout, spreads the
micro-batches over the data-parallel replicas (assign.py), picks each replica's pipeline
schedule by simulation (schedule.py) and keeps the layout whose simulated step is shortest.
Baselines (baselines.py) go through the same pricing and simulation, so they compare fairly; the
exact ones are candidates of every step too (``CANDIDATES``), so the plugin's plan is never slower
than theirs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ...layout import RankLayout
from ...lengths.packing import pack_rows
from ..sequence_parallel.groups import plan_groups
from ..steps.assign import split_for_replicas
from ..steps.instructions import ExecutionPlan, build_execution_plans
from ..steps.microbatch import InfeasibleError, partition
from ..steps.pricing import cheapest_feasible, make_micro_batch, same_recompute
from ..steps.replicas import schedule_replicas
from ..steps.spec import PlannerSpec
from ..steps.types import MicroBatch, StepPlan


def execution_plans(
    plan: StepPlan, hidden_size: int, *, split_rank: int | None = None
) -> dict[tuple[int, int], ExecutionPlan]:
    """Every rank's execution plan of a step, keyed (data-parallel column, stage); ``split_rank``:
    an encoder-decoder's first decoder stage, its micro-batches (input, target) pairs.

    Global rank = stage * columns + column: stage-major, as DeepSpeed's PipeDataParallelTopology
    and Megatron's default rank order lay ranks out, so peers name the host's own ranks. Every
    column of a sequence-parallel group runs the group's schedule on its shard of each row, and
    sends to and receives from the same column on the neighbouring stages."""
    out = {}
    dp = plan.num_columns
    if len({(r.tp, len(r.schedule.stages)) for r in plan.replicas}) > 1:
        raise ValueError(
            f"{plan.method}: its pipelines mix tensor/pipeline degrees "
            f"{sorted({(r.tp, len(r.schedule.stages)) for r in plan.replicas})}; DeepSpeed and Megatron "
            "build uniform replicas, so such a strategy is simulated only (dynplugin bench strategy)"
        )
    for rep in plan.replicas:
        if rep.first % rep.size:
            raise ValueError(
                f"a sequence-parallel group of {rep.size} columns starts at column {rep.first}: groups "
                "must be aligned (start at a multiple of their size) to match the process groups"
            )
        pp = len(rep.schedule.stages)
        for c in rep.columns:
            ranks = RankLayout.of(dp, pp).column_ranks(c)
            for s, ep in enumerate(
                build_execution_plans(
                    rep.micro_batches,
                    rep.schedule,
                    column=c,
                    stage_ranks=ranks,
                    hidden_size=hidden_size,
                    group=rep.first,
                    split_rank=split_rank,
                )
            ):
                out[(c, s)] = ep
    return out


def plan_step(
    lengths: Sequence[int], spec: PlannerSpec, *, native: bool = True, grouping: Sequence[int] | None = None
) -> StepPlan:
    """The plugin's plan for one global batch.

    Candidates: the DP partition for each allowed layout and, with packing allowed, fixed-length
    rows (first-fit decreasing into rows of ``spec.row_len``) given the planner's own recompute,
    balancing and schedule search. Rows of similar size pipeline with small bubbles where the
    DP's contiguous runs leave one long micro-batch holding up the rest; the simulation decides.
    With sequence parallelism (``spec.sp_sizes`` other than (1,)) the plans over groupings of the
    columns (groups.py) compete with these where size 1 is allowed; ``grouping`` forces one
    grouping (sizes in column order).
    """
    if grouping is not None or spec.sp_sizes != (1,):
        grouped = same_recompute(plan_groups(lengths, spec, native=native, grouping=grouping), spec=spec)
        if grouping is not None:
            return grouped
        if 1 in spec.sp_sizes:
            try:
                plain = plan_step(lengths, replace(spec, sp_sizes=(1,)), native=native)
            except ValueError:  # a sequence fits no single rank, or too few for every rank: only grouped plans run
                plain = None
            grouped = plain if plain is not None and plain.iteration_ms <= grouped.iteration_ms else grouped
        return _no_worse_than_the_baselines(grouped, lengths, spec, SP_CANDIDATES)
    candidates: list[list[MicroBatch]] = []
    infeasible: InfeasibleError | None = None
    for layout in spec.layouts:
        try:
            part = partition(
                lengths,
                spec.cost,
                layout=layout,
                stages=spec.stages,
                memory=spec.memory,
                dp=spec.dp,
                recomputes=spec.recomputes,
                tp=spec.tp,
                native=native,
            )
        except InfeasibleError as exc:  # padding holds more than packing: the longest sequence may fit one layout only
            infeasible = infeasible or exc
            continue
        candidates.append(
            [
                make_micro_batch(part.order[a:b], lengths, spec=spec, layout=layout, recompute=rc)
                for a, b, rc in zip(part.bounds, part.bounds[1:], part.recompute)
            ]
        )
    if "packed" in spec.layouts and spec.row_len and max(lengths) <= spec.row_len:
        try:
            rows = split_for_replicas(pack_rows(lengths, spec.row_len), lengths, spec.dp, equal_counts=True)
        except ValueError:  # too few sequences for equal counts: the DP candidates remain
            rows = None
        mbs = cheapest_feasible(rows, lengths, spec=spec) if rows else None
        if mbs is not None:
            candidates.append(mbs)
    if not candidates:
        raise infeasible  # type: ignore[misc]  # every layout was tried, and each raised
    best = None
    for mbs in candidates:
        plan = same_recompute(schedule_replicas(mbs, spec=spec, method="dynapipe"), spec=spec)
        if best is None or plan.iteration_ms < best.iteration_ms:
            best = plan
    return _no_worse_than_the_baselines(best, lengths, spec, CANDIDATES)


# The baselines whose plans the plugin's planner also weighs: those that compute what the plugin's own
# plans compute (every document attending to itself only; packing_full's rows attend across documents,
# so it is no candidate), priced and simulated the same way; the plugin's plan can then lose to none.
CANDIDATES = ("fixed_padding", "token_budget", "packing_varlen")
SP_CANDIDATES = ("fixed_sp", "megatron_hybrid_cp", "dcp_bucket")


def _no_worse_than_the_baselines(
    best: StepPlan, lengths: Sequence[int], spec: PlannerSpec, names: Sequence[str]
) -> StepPlan:
    """``best``, or a baseline's plan of the same global batch where that is faster and runs on this
    spec (its layouts, its memory, equal counts where ZeRO-2/3 need them), then carried as the plugin's
    own (``method`` "dynapipe", ``candidate`` the baseline it came from)."""
    from .baselines import plan_baseline

    max_len = spec.row_len or int(max(lengths))
    for name in names:
        try:
            plan = same_recompute(plan_baseline(name, lengths, spec, max_len), spec=spec)
        except ValueError:  # infeasible for this batch and spec (InfeasibleError is one)
            continue
        if plan.iteration_ms < best.iteration_ms * (1 - 1e-9) and _runs_here(plan, spec):
            best = replace(plan, method="dynapipe", candidate=name)
    return best


def _runs_here(plan: StepPlan, spec: PlannerSpec) -> bool:
    mbs = [mb for r in plan.replicas for mb in r.micro_batches]
    return (
        all(mb.layout in spec.layouts and mb.sp in spec.sp_sizes for mb in mbs)
        and all(p <= m.budget for r in plan.replicas for p, m in zip(r.sim.peak_bytes, spec.memory))
        and (not spec.equal_counts or len({len(r.micro_batches) for r in plan.replicas}) == 1)
    )
