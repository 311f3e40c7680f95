"""The planner: a global batch of sequence lengths in, the fastest step plan out.

plan_step runs the DynaPipe partition (microbatch.py) for each allowed layout, spreads the
micro-batches over the data-parallel replicas (assign.py), picks each replica's pipeline
schedule by simulation (schedule.py) and keeps the layout whose simulated step is shortest.
Baselines (baselines.py) go through the same pricing and simulation, so they compare fairly.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from ..config import DynPluginConfig
from ..cost.model import LAYOUTS, RECOMPUTES, Layout, Recompute, StageSpec, features, split_layers, tensor_shape
from ..cost.sequence_parallel import LayerComm, attention_kind, group_sizes
from ..cost.table import TableCostModel, evaluate_checkpointed, evaluate_stage
from ..layout import RankLayout
from ..lengths.packing import pack_rows
from .assign import assign_to_replicas, split_for_replicas
from .instructions import ExecutionPlan, build_execution_plans
from .microbatch import InfeasibleError, StageMemory, partition
from .schedule import choose_schedule, one_f_one_b
from .simulator import simulate, stage_peak_bytes
from .types import LinkSpec, MicroBatch, Schedule, SimResult

MB = 1 << 20
ACT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class PlannerSpec:
    """Everything the planner knows about the model and the cluster, for one step."""

    cost: TableCostModel
    stages: tuple[StageSpec, ...]
    memory: tuple[StageMemory, ...]
    dp: int
    link: LinkSpec
    hidden_size: int
    layouts: tuple[Layout, ...] = LAYOUTS
    recomputes: tuple[Recompute, ...] = RECOMPUTES
    tp: int = 1
    seed: int = 0
    row_len: int | None = None  # fixed-length packing rows (the max sequence length) tried as a candidate
    schedule: str = "auto"  # pipeline.schedule: auto | adaptive | 1f1b
    update_ms: float = 0.0  # gradient all-reduce + optimizer step after the last micro-batch
    sp_sizes: tuple[int, ...] = (1,)  # sequence-parallel group sizes allowed ((1,) = DynaPipe alone)
    sp_attention: str = "auto"  # ulysses | ring | auto
    pyramid: bool = False  # checkpoint per micro-batch only as many layers as memory needs
    equal_counts: bool = False  # every rank runs the same number of micro-batches (ZeRO-2/3, or balance = intra)
    same_recompute: bool = False  # every rank recomputes alike at each micro-batch of its run order (ZeRO-3)
    sp_link: tuple[LinkSpec, LinkSpec] = (LinkSpec(100.0), LinkSpec(12.5))  # inside a node, across nodes
    devices_per_node: int = 1

    @property
    def pp(self) -> int:
        return len(self.stages)

    def layer_comm(self, sp: int, recompute: Recompute) -> LayerComm:
        """Per layer, the attention collectives of a micro-batch split over ``sp`` ranks."""
        if sp <= 1:
            return LayerComm()
        key = (sp, recompute)
        if key not in self._comm:
            # a group's ranks are neighbouring columns of one stage: consecutive global ranks
            link = self.sp_link[0] if sp * self.tp <= self.devices_per_node else self.sp_link[1]
            kind = attention_kind(sp, self.sp_attention, self.cost.num_heads, self.cost.num_kv_heads)
            self._comm[key] = self.cost.collectives.layer(
                sp, kind, recompute, hidden=self.hidden_size // self.tp,
                kv_hidden=(self.cost.kv_hidden_size or self.hidden_size) // self.tp,
                act_bytes=ACT_BYTES.get(self.cost.dtype, 2), link_gb_per_s=link.gb_per_s, latency_us=link.latency_us)
        return self._comm[key]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_comm", {})


def planner_spec(
    cost: TableCostModel, config: DynPluginConfig, *, dp: int, zero_stage: int = 0, tp: int = 1,
    hidden_size: int | None = None, seed: int = 0, state_bytes: float | None = None,
) -> PlannerSpec:
    """Build the spec from the plugin config: stages, per-stage activation budget after model
    states (ZeRO stage and dp), the link between stages, allowed layouts and recompute modes.
    Padded micro-batches are priced and shaped at ``microbatching.pad_multiple``, the width the
    collate pads to.

    ``state_bytes``: a sharding plan's model states per rank (``ShardPlan.state_bytes``) in place
    of ZeRO's, on one pipeline stage; activations then get ``sharding.memory_budget_mb`` (else the
    device's memory) minus them, the budget the plan was searched for. Sharded modules gather in
    step on every rank, so the plan then has ZeRO-3's rules whatever ``zero_stage`` says: equal
    micro-batch counts and the same recompute per micro-batch index."""
    pipe, cluster, mb = config.pipeline, config.cluster, config.microbatching
    cost = cost.with_pad_multiple(mb.pad_multiple)
    if pipe.layers_per_stage:
        if sum(pipe.layers_per_stage) != cost.num_layers:
            raise ValueError(f"pipeline.layers_per_stage sums to {sum(pipe.layers_per_stage)}, the model has {cost.num_layers} layers")
        stages = tuple(StageSpec(n, i == 0, i == pipe.stages - 1) for i, n in enumerate(pipe.layers_per_stage))
    else:
        stages = balanced_split(cost, pipe.stages, tp=tp)
    device_bytes = cluster.device.memory_mb * MB * cluster.device.memory_fraction
    if state_bytes is not None:
        if len(stages) > 1:
            raise ValueError(f"a sharding plan's model states (state_bytes) are those of the whole model: they need "
                             f"pipeline.stages = 1, not {len(stages)}")
        budget = config.sharding.memory_budget_mb
        device_bytes = budget * MB if budget else device_bytes
        if state_bytes >= device_bytes:
            raise ValueError(f"the sharding plan's model states take {state_bytes / MB:.0f} MB of the "
                             f"{device_bytes / MB:.0f} MB per rank (sharding.memory_budget_mb, else the device's "
                             "memory): none is left for activations; search the plan for this budget")
    memory = []
    for i, s in enumerate(stages):
        states = state_bytes if state_bytes is not None else \
            cost.model_state_bytes(stage=s, zero_stage=zero_stage, dp=dp, tp=tp).total
        if states >= device_bytes:
            raise ValueError(
                f"pipeline stage {i} needs {states / MB:.0f} MB for model states (ZeRO-{zero_stage}, dp={dp}) but "
                f"a device has {device_bytes / MB:.0f} MB; add pipeline stages, raise the ZeRO stage or the memory"
            )
        memory.append(StageMemory(budget=device_bytes - states, in_flight=len(stages) - i))
    same_node = len(stages) * tp <= cluster.devices_per_node
    link = LinkSpec(cluster.intra_node_gb_per_s if same_node else cluster.inter_node_gb_per_s, cluster.latency_us)
    hidden = hidden_size or cost.hidden_size
    if not hidden:
        raise ValueError("the planner needs the model's hidden size (cost_model.model.hidden_size)")
    # Only what the cost model can price: a profile may measure fewer modes than exist.
    layouts = tuple(l for l in (LAYOUTS if mb.layout == "auto" else (mb.layout,))
                    if any((l, r, tp) in cost.tables for r in RECOMPUTES))
    recomputes = tuple(r for r in (RECOMPUTES if mb.recompute == "auto" else (mb.recompute,))
                       if all((l, r, tp) in cost.tables for l in layouts))
    if not layouts or not recomputes:
        have = ", ".join(f"{l}/{r}/tp{t}" for l, r, t in sorted(cost.tables))
        raise ValueError(f"cost model {cost.name!r} cannot price microbatching.layout={mb.layout!r}, "
                         f"recompute={mb.recompute!r} at tp={tp} (it has {have}); profile those or change the config")
    dp_same_node = dp * len(stages) * tp <= cluster.devices_per_node
    update = cost.update_ms(stages, zero_stage=zero_stage, dp=dp, tp=tp,
                            link_gb_per_s=cluster.intra_node_gb_per_s if dp_same_node else cluster.inter_node_gb_per_s)
    sp = config.sequence_parallel
    sizes = group_sizes(dp, sp.sizes) if sp.enabled else (1,)
    for k in sizes:
        attention_kind(k, sp.attention, cost.num_heads, cost.num_kv_heads)  # a size Ulysses cannot split: say so now
    sharded = zero_stage >= 3 or state_bytes is not None  # modules gathered in step on every rank
    equal = zero_stage >= 2 or sharded or (sp.enabled and sp.balance == "intra")
    sp_link = (LinkSpec(cluster.intra_node_gb_per_s, cluster.latency_us), LinkSpec(cluster.inter_node_gb_per_s, cluster.latency_us))
    return PlannerSpec(cost, stages, tuple(memory), dp, link, hidden, layouts, recomputes, tp, seed, mb.max_seq_len,
                       pipe.schedule, update, sizes, sp.attention, sp.pyramid and "none" in recomputes, equal,
                       sharded, sp_link, cluster.devices_per_node)


def balanced_split(cost: TableCostModel, num_stages: int, *, tokens: int = 4096, tp: int = 1) -> tuple[StageSpec, ...]:
    """Layers per stage so that stage times are as even as they can be: the first stage also
    runs the embedding and the last the head, so an even split leaves the last stage slowest
    and every other stage waiting on it. Priced on a ``tokens``-token packed micro-batch."""
    stages = list(split_layers(cost.num_layers, num_stages))
    if num_stages == 1:
        return tuple(stages)
    table = cost.table("packed", "none", tp)
    f = features([tokens], "packed", cost.pad_multiple)

    def t(s: StageSpec) -> float:
        c = evaluate_stage(table, f, s)
        return c.forward_ms + c.backward_ms

    while True:
        times = [t(s) for s in stages]
        hi, lo = int(np.argmax(times)), int(np.argmin(times))
        if stages[hi].num_layers <= 1:
            break
        moved = list(stages)
        moved[hi] = StageSpec(stages[hi].num_layers - 1, stages[hi].first, stages[hi].last)
        moved[lo] = StageSpec(stages[lo].num_layers + 1, stages[lo].first, stages[lo].last)
        if max(t(s) for s in moved) >= max(times) - 1e-9:
            break
        stages = moved
    return tuple(stages)


@dataclass(frozen=True)
class ReplicaPlan:
    """One pipeline replica: ``size`` neighbouring data-parallel columns from column ``first``
    (a sequence-parallel group; DynaPipe's replicas are one column wide) running its ordered
    micro-batches through every stage, each row split over the group's ranks."""

    micro_batches: tuple[MicroBatch, ...]
    schedule: Schedule
    sim: SimResult
    first: int = 0
    size: int = 1
    tp: int = 1  # tensor-parallel ranks per stage (pipelines of a simulated strategy may differ)

    @property
    def gpus(self) -> int:
        return self.size * self.tp * len(self.schedule.stages)

    @property
    def columns(self) -> range:
        return range(self.first, self.first + self.size)


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step of the whole cluster: a pipeline plan per replica; the replicas' columns
    tile the data-parallel columns in order (aligned power-of-two groups)."""

    method: str
    layout: Layout
    replicas: tuple[ReplicaPlan, ...]
    update_ms: float = 0.0  # after every replica's pipeline drains: all-reduce + optimizer step

    @property
    def iteration_ms(self) -> float:
        return max(r.sim.makespan_ms for r in self.replicas) + self.update_ms

    @property
    def micro_batches(self) -> list[MicroBatch]:
        return [mb for r in self.replicas for mb in r.micro_batches]

    @property
    def columns(self) -> int:
        return sum(r.size for r in self.replicas)

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return tuple(r.size for r in self.replicas)

    @property
    def extrapolated(self) -> int:
        """Micro-batches priced beyond what the cost model measured."""
        return sum(mb.extrapolated for mb in self.micro_batches)

    @property
    def padding_fraction(self) -> float:
        """Token slots holding padding (packed rows hold none)."""
        slots = sum(mb.token_slots for mb in self.micro_batches)
        return 1.0 - sum(mb.real_tokens for mb in self.micro_batches) / slots

    @property
    def peak_bytes(self) -> float:
        return max(max(r.sim.peak_bytes) for r in self.replicas)

    @property
    def bubble_fraction(self) -> float:
        return max(r.sim.bubble_fraction for r in self.replicas)


def execution_plans(plan: StepPlan, hidden_size: int) -> dict[tuple[int, int], ExecutionPlan]:
    """Every rank's execution plan of a step, keyed (data-parallel column, stage).

    Global rank = stage * columns + column: stage-major, as DeepSpeed's PipeDataParallelTopology
    and Megatron's default rank order lay ranks out, so peers name the host's own ranks. Every
    column of a sequence-parallel group runs the group's schedule on its shard of each row, and
    sends to and receives from the same column on the neighbouring stages."""
    out = {}
    dp = plan.columns
    if len({(r.tp, len(r.schedule.stages)) for r in plan.replicas}) > 1:
        raise ValueError(f"{plan.method}: its pipelines mix tensor/pipeline degrees "
                         f"{sorted({(r.tp, len(r.schedule.stages)) for r in plan.replicas})}; DeepSpeed and Megatron "
                         "build uniform replicas, so such a strategy is simulated only (dynplugin bench strategy)")
    for rep in plan.replicas:
        if rep.first % rep.size:
            raise ValueError(f"a sequence-parallel group of {rep.size} columns starts at column {rep.first}: groups "
                             "must be aligned (start at a multiple of their size) to match the process groups")
        pp = len(rep.schedule.stages)
        for c in rep.columns:
            ranks = RankLayout.of(dp, pp).column_ranks(c)
            for s, ep in enumerate(build_execution_plans(rep.micro_batches, rep.schedule, column=c, stage_ranks=ranks,
                                                         hidden_size=hidden_size, group=rep.first)):
                out[(c, s)] = ep
    return out


def make_micro_batch(
    sample_ids: Sequence[int], lengths: Sequence[int], spec: PlannerSpec, layout: Layout, recompute: Recompute,
    sp: int = 1, checkpointed: Sequence[int] | None = None,
) -> MicroBatch:
    """Price one micro-batch on every stage, per rank of a group of ``sp``, on exactly the tensors
    the collate will build. ``checkpointed``: per stage, the layers run under ``recompute``
    (pyramid checkpointing); default all of them (none under ``recompute="none"``)."""
    lens = tuple(int(lengths[i]) for i in sample_ids)
    table = spec.cost.table(layout, recompute, spec.tp)
    f = features(lens, layout, spec.cost.pad_multiple, sp)
    extrapolated = not table.covers(f.slots, f.max_len)
    whole_stage = _whole_stage_counts(recompute, spec)
    counts = whole_stage if checkpointed is None else tuple(int(c) for c in checkpointed)
    whole = counts == whole_stage
    if whole:
        costs = [evaluate_stage(table, f, s) for s in spec.stages]
    else:
        plain = spec.cost.table(layout, "none", spec.tp)
        extrapolated = extrapolated or not plain.covers(f.slots, f.max_len)
        costs = [evaluate_checkpointed(table, plain, f, s, c) for s, c in zip(spec.stages, counts)]
    fwd, bwd = [c.forward_ms for c in costs], [c.backward_ms for c in costs]
    if sp > 1:
        comm, rerun = spec.layer_comm(sp, "none"), spec.layer_comm(sp, recompute)
        for i, (s, c) in enumerate(zip(spec.stages, counts)):
            fwd[i] += s.num_layers * comm.forward_ms(f.slots)
            bwd[i] += (s.num_layers - c) * comm.backward_ms(f.slots) + c * rerun.backward_ms(f.slots)
    shape = tensor_shape(lens, layout, spec.cost.pad_multiple, sp)
    act = shape[0] * shape[1] // sp * spec.hidden_size * ACT_BYTES.get(spec.cost.dtype, 2) / spec.tp
    return MicroBatch(
        sample_ids=tuple(int(i) for i in sample_ids), seq_lens=lens, layout=layout, recompute=recompute,
        forward_ms=tuple(fwd), backward_ms=tuple(bwd),
        stored_bytes=tuple(c.stored_bytes for c in costs), peak_bytes=tuple(c.peak_bytes for c in costs),
        activation_bytes=act, shape=shape, sp=sp, checkpointed=() if whole else counts, extrapolated=extrapolated,
    )


def schedule_replicas(
    micro_batches: Sequence[MicroBatch], spec: PlannerSpec, *, method: str, balance: bool = True, adaptive: bool = True,
) -> StepPlan:
    """Spread micro-batches over replicas (balanced, or round-robin as host frameworks do) and
    schedule each replica's pipeline (searched, or plain 1F1B in the given order)."""
    if balance:
        groups = assign_to_replicas([mb.time_ms for mb in micro_batches], spec.dp)
    else:
        groups = [list(range(r, len(micro_batches), spec.dp)) for r in range(spec.dp)]
    replicas = []
    for r, g in enumerate(groups):
        mbs = tuple(micro_batches[i] for i in g)
        if not mbs:
            raise ValueError(f"{method}: a data-parallel replica got no micro-batch ({len(micro_batches)} for dp={spec.dp})")
        replicas.append(schedule_replica(mbs, spec, first=r, adaptive=adaptive))
    return StepPlan(method, micro_batches[0].layout, tuple(replicas), spec.update_ms)


def schedule_replica(mbs: Sequence[MicroBatch], spec: PlannerSpec, *, first: int, size: int = 1,
                     adaptive: bool = True) -> ReplicaPlan:
    """One replica's pipeline: the schedule searched by simulation within the memory budget,
    then recompute relaxed where it leaves memory spare, by whole micro-batches and then (pyramid
    checkpointing) by layers; or plain 1F1B in the given order."""
    mbs = tuple(mbs)
    if adaptive:
        schedule, sim = choose_schedule(mbs, spec.link, memory_budget=[m.budget for m in spec.memory], seed=spec.seed,
                                        candidates=4, policy=spec.schedule)
        mbs, sim = relax_recompute(mbs, schedule, sim, spec)
        if spec.pyramid:
            from .pyramid import fewest_checkpointed  # here, not on top: pyramid.py prices through this module
            mbs, sim = fewest_checkpointed(mbs, schedule, sim, spec)
    else:
        schedule = one_f_one_b(len(mbs), spec.pp)
        sim = simulate(mbs, schedule, spec.link)
    return ReplicaPlan(mbs, schedule, sim, first=first, size=size, tp=spec.tp)


def relax_recompute(
    mbs: tuple[MicroBatch, ...], schedule: Schedule, sim: SimResult, spec: PlannerSpec
) -> tuple[tuple[MicroBatch, ...], SimResult]:
    """Recompute less where the schedule leaves memory to spare.

    The partition prices each micro-batch as if every micro-batch in flight with it were as big,
    which forces recompute on long ones that in fact share the pipeline with short ones. With
    the schedule fixed, the simulator knows each stage's true peak: try each micro-batch in a
    cheaper mode (most time saved first) and keep the change if every stage still fits and the
    step got no slower, as DCP's pyramid checkpointing spends spare memory on less recompute.

    A stage's peak depends on its op order only (``stage_peak_bytes``), and with the order fixed
    no op getting shorter can lengthen the step: a change that shortens every op needs no
    simulation, only the others do (fitted tables may price one op of a cheaper mode slower).
    """
    budget = [m.budget for m in spec.memory]
    cheaper = {rc: spec.recomputes[: spec.recomputes.index(rc)] for rc in spec.recomputes}
    current = list(mbs)
    stale = False  # sim no longer describes current (changes accepted without simulating)
    for i in sorted(range(len(current)), key=lambda i: -current[i].time_ms):
        for rc in cheaper[current[i].recompute]:
            old = current[i]
            candidate = make_micro_batch(old.sample_ids, _lengths_of(old), spec, old.layout, rc, sp=old.sp)
            if not in_range(candidate, spec):
                continue
            trial = current[:i] + [candidate] + current[i + 1:]
            if any(stage_peak_bytes(trial, ops, s) > budget[s] for s, ops in enumerate(schedule.stages)):
                continue
            if all(nf <= f and nb <= b for nf, f, nb, b in zip(candidate.forward_ms, old.forward_ms,
                                                               candidate.backward_ms, old.backward_ms)):
                current, stale = trial, True
                break
            if stale:
                sim, stale = simulate(current, schedule, spec.link), False
            result = simulate(trial, schedule, spec.link)
            if result.makespan_ms <= sim.makespan_ms:
                current, sim = trial, result
                break
    return tuple(current), simulate(current, schedule, spec.link) if stale else sim


def in_range(mb: MicroBatch, spec: PlannerSpec) -> bool:
    """Inside what the cost model measured for the micro-batch's layout and recompute mode, or
    beyond it where the cost model allows extrapolation (the micro-batch then says so)."""
    return spec.cost.allow_extrapolation or not mb.extrapolated


def usable(mb: MicroBatch, spec: PlannerSpec) -> bool:
    """In range, and within every stage's activation budget with the 1F1B in-flight count."""
    return in_range(mb, spec) and all(
        m.fits(st, pk) for m, st, pk in zip(spec.memory, mb.stored_bytes, mb.peak_bytes)
    )


def _lengths_of(mb: MicroBatch) -> dict[int, int]:
    return dict(zip(mb.sample_ids, mb.seq_lens))


def plan_step(lengths: Sequence[int], spec: PlannerSpec, *, native: bool = True,
              grouping: Sequence[int] | None = None) -> StepPlan:
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
        from .groups import plan_groups  # groups.py builds on this module

        grouped = same_recompute(plan_groups(lengths, spec, native=native, grouping=grouping), spec)
        if grouping is not None or 1 not in spec.sp_sizes:
            return grouped
        try:
            plain = plan_step(lengths, replace(spec, sp_sizes=(1,)), native=native)
        except ValueError:  # a sequence fits no single rank, or too few for every rank: only grouped plans run
            return grouped
        return grouped if grouped.iteration_ms < plain.iteration_ms else plain
    candidates: list[list[MicroBatch]] = []
    infeasible: InfeasibleError | None = None
    for layout in spec.layouts:
        try:
            part = partition(lengths, spec.cost, layout=layout, stages=spec.stages, memory=spec.memory, dp=spec.dp,
                             recomputes=spec.recomputes, tp=spec.tp, native=native)
        except InfeasibleError as exc:  # padding holds more than packing: the longest sequence may fit one layout only
            infeasible = infeasible or exc
            continue
        candidates.append([make_micro_batch(part.order[a:b], lengths, spec, layout, rc)
                           for a, b, rc in zip(part.bounds, part.bounds[1:], part.recompute)])
    if "packed" in spec.layouts and spec.row_len and max(lengths) <= spec.row_len:
        try:
            rows = split_for_replicas(pack_rows(lengths, spec.row_len), lengths, spec.dp, equal_counts=True)
        except ValueError:  # too few sequences for equal counts: the DP candidates remain
            rows = None
        mbs = cheapest_feasible(rows, lengths, spec) if rows else None
        if mbs is not None:
            candidates.append(mbs)
    if not candidates:
        raise infeasible  # type: ignore[misc]  # every layout was tried, and each raised
    best = None
    for mbs in candidates:
        plan = same_recompute(schedule_replicas(mbs, spec, method="dynapipe"), spec)
        if best is None or plan.iteration_ms < best.iteration_ms:
            best = plan
    return best


def checkpointed_layers(mb: MicroBatch, spec: PlannerSpec) -> tuple[int, ...]:
    """Checkpointed layers per stage (a whole-stage mode: all of them, none under no recompute)."""
    return tuple(mb.checkpointed) if mb.checkpointed else _whole_stage_counts(mb.recompute, spec)


def _whole_stage_counts(recompute: Recompute, spec: PlannerSpec) -> tuple[int, ...]:
    return tuple(s.num_layers if recompute != "none" else 0 for s in spec.stages)


def same_recompute(plan: StepPlan, spec: PlannerSpec) -> StepPlan:
    """With ``spec.same_recompute`` (ZeRO-3), every replica's i-th micro-batch (in run order)
    recomputes alike: ZeRO-3 gathers each module's parameters over every rank in the order the
    modules run, and recompute re-runs modules in backward, so ranks that recompute differently
    desynchronise the gathers (a hang under NCCL). Where they differ, each takes the most
    recompute among them (the strongest mode; its most checkpointed layers, or all of them where
    modes differ): memory only falls, the schedules stay, the replicas are simulated again."""
    if not spec.same_recompute or len(plan.replicas) < 2:
        return plan
    orders = [r.schedule.order for r in plan.replicas]
    if len({len(o) for o in orders}) > 1:
        raise ValueError("the same recompute per micro-batch needs equal micro-batch counts on every replica")
    new = [list(r.micro_batches) for r in plan.replicas]
    for pos in range(len(orders[0])):
        mbs = [r.micro_batches[o[pos]] for r, o in zip(plan.replicas, orders)]
        if len({(mb.recompute, checkpointed_layers(mb, spec)) for mb in mbs}) == 1:
            continue
        mode = max((mb.recompute for mb in mbs), key=RECOMPUTES.index)
        counts = None  # every layer, where the modes differ
        if all(mb.recompute == mode for mb in mbs):
            counts = [max(c) for c in zip(*(checkpointed_layers(mb, spec) for mb in mbs))]
        for r, (mb, o) in enumerate(zip(mbs, orders)):
            new[r][o[pos]] = make_micro_batch(mb.sample_ids, _lengths_of(mb), spec, mb.layout, mode, sp=mb.sp,
                                              checkpointed=counts)
    replicas = tuple(replace(r, micro_batches=tuple(m), sim=simulate(m, r.schedule, spec.link))
                     for r, m in zip(plan.replicas, new))
    return replace(plan, replicas=replicas)


def cheapest_feasible(groups: Sequence[Sequence[int]], lengths: Sequence[int], spec: PlannerSpec,
                      layout: Layout = "packed", sp: int = 1) -> list[MicroBatch] | None:
    """Each group in its cheapest recompute mode that fits; None if one fits in none."""
    out = []
    for g in groups:
        best = None
        for rc in spec.recomputes:
            mb = make_micro_batch(g, lengths, spec, layout, rc, sp=sp)
            if usable(mb, spec) and (best is None or mb.time_ms < best.time_ms):
                best = mb
        if best is None:
            return None
        out.append(best)
    return out


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
        mb = make_micro_batch([0], [longest], spec, layout, rc, sp=sp)
        if all(p <= m.budget for p, m in zip(mb.peak_bytes, spec.memory)):
            if spec.pyramid:  # alone, it may keep some layers' activations
                from .pyramid import fewest_checkpointed_alone  # here: pyramid.py prices through this module
                mb = fewest_checkpointed_alone(mb, spec)
            hops = 2 * (spec.pp - 1) * spec.link.transfer_ms(mb.activation_bytes)
            best = min(best, sum(mb.forward_ms) + sum(mb.backward_ms) + hops)
    return best + spec.update_ms
