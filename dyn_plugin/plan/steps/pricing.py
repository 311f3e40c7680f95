"""Pricing: micro-batches priced on every stage, and recompute chosen or relaxed within memory.

``make_micro_batch`` prices one micro-batch on exactly the tensors the collate builds;
``usable``/``in_range`` say whether it fits and is measured; ``cheapest_feasible`` picks each
group's cheapest recompute mode; ``relax_recompute`` and ``same_recompute`` change recompute
modes on a fixed schedule (less where memory is spare; alike on every replica for ZeRO-3).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from ...cost.model import RECOMPUTES, Features, Layout, Recompute, features, tensor_shape
from ...cost.table import LINEAR_HELD, evaluate_checkpointed, evaluate_stage, weight_grad_ms
from .simulator import simulate, stage_peak_bytes
from .spec import ACT_BYTES, PlannerSpec, StepSpec
from .types import MicroBatch, Schedule, SimResult, StepPlan

# a micro-batch priced in another recompute mode; None where that is out of the measured range
Reprice = Callable[[MicroBatch, Recompute], "MicroBatch | None"]
# a micro-batch priced in another recompute mode with these checkpointed layers per stage (None: all)
Remake = Callable[[MicroBatch, Recompute, "list[int] | None"], MicroBatch]


def make_micro_batch(
    sample_ids: Sequence[int],
    lengths: Sequence[int],
    *,
    spec: PlannerSpec,
    layout: Layout,
    recompute: Recompute,
    sp: int = 1,
    checkpointed: Sequence[int] | None = None,
) -> MicroBatch:
    """Price one micro-batch on every stage, per rank of a group of ``sp``, on exactly the tensors
    the collate will build. ``checkpointed``: per stage, the layers run under ``recompute``
    (pyramid checkpointing); default all of them (none under ``recompute="none"``)."""
    ids = tuple(int(i) for i in sample_ids)
    return _sequences(ids, tuple(int(lengths[i]) for i in ids), spec, layout, recompute, sp, checkpointed)


def repriced(
    mb: MicroBatch, *, spec: PlannerSpec, recompute: Recompute, checkpointed: Sequence[int] | None = None
) -> MicroBatch:
    """``mb``'s sequences priced under another recompute mode (or checkpointed layer counts)."""
    return _sequences(mb.sample_ids, mb.seq_lens, spec, mb.layout, recompute, mb.sp, checkpointed)


def _sequences(
    ids: tuple[int, ...],
    lens: tuple[int, ...],
    spec: PlannerSpec,
    layout: Layout,
    recompute: Recompute,
    sp: int,
    checkpointed: Sequence[int] | None,
) -> MicroBatch:
    counts = None if checkpointed is None else tuple(int(c) for c in checkpointed)
    return _cached(
        spec,
        ids,
        ("sequences", lens, layout, recompute, sp, counts),
        lambda: _price(
            ids,
            lens,
            features(lens, layout, spec.cost.pad_multiple, sp),
            tensor_shape(lens, layout, spec.cost.pad_multiple, sp),
            spec=spec,
            layout=layout,
            recompute=recompute,
            sp=sp,
            checkpointed=counts,
        ),
    )


def price_features(
    sample_ids: tuple[int, ...],
    seq_lens: tuple[int, ...],
    f: Features,
    shape: tuple[int, int],
    *,
    spec: PlannerSpec,
    layout: Layout,
    recompute: Recompute,
    sp: int = 1,
    checkpointed: Sequence[int] | None = None,
) -> MicroBatch:
    """The micro-batch of ``seq_lens`` whose kernels run over the token slots and attention pairs
    ``f`` in tensors of ``shape`` (a token slice's: its queries over the keys before it,
    ``token_slices.py``), priced on every stage."""
    counts = None if checkpointed is None else tuple(int(c) for c in checkpointed)
    return _cached(
        spec,
        sample_ids,
        ("features", seq_lens, f, shape, layout, recompute, sp, counts),
        lambda: _price(
            sample_ids, seq_lens, f, shape, spec=spec, layout=layout, recompute=recompute, sp=sp, checkpointed=counts
        ),
    )


def _cached(spec: PlannerSpec, sample_ids: tuple[int, ...], key: tuple, price: Callable[[], MicroBatch]) -> MicroBatch:
    """A micro-batch priced once per spec: one plan prices the same lengths in the same mode about
    three times over (partition, recompute relaxation, pyramid and split-backward searches, the
    baselines), and the steps after it price many again. Only the sample ids differ between those."""
    priced = spec.priced.get(key)
    if priced is None:
        priced = price()
        spec.remember_price(key, priced)
    return priced if priced.sample_ids == sample_ids else replace(priced, sample_ids=sample_ids)


def _price(
    sample_ids: tuple[int, ...],
    seq_lens: tuple[int, ...],
    f: Features,
    shape: tuple[int, int],
    *,
    spec: PlannerSpec,
    layout: Layout,
    recompute: Recompute,
    sp: int,
    checkpointed: tuple[int, ...] | None,
) -> MicroBatch:
    table = spec.cost.table(layout, recompute, spec.tp)
    extrapolated = not table.covers(f.slots, f.max_len)
    whole_stage = _whole_stage_counts(recompute, spec)
    counts = whole_stage if checkpointed is None else checkpointed
    whole = counts == whole_stage
    if whole:
        costs = [evaluate_stage(table, f, s) for s in spec.stages]
    else:
        plain = spec.cost.table(layout, "none", spec.tp)
        extrapolated = extrapolated or not plain.covers(f.slots, f.max_len)
        costs = [evaluate_checkpointed(table, plain, f, s, c) for s, c in zip(spec.stages, counts)]
    fwd, bwd = [c.forward_ms for c in costs], [c.backward_ms for c in costs]
    stored, peak = [c.stored_bytes for c in costs], [c.peak_bytes for c in costs]
    if sp > 1:
        comm, rerun = spec.layer_comm(sp, "none"), spec.layer_comm(sp, recompute)
        for i, (s, c) in enumerate(zip(spec.stages, counts)):
            fwd[i] += s.num_layers * comm.forward_ms(f.slots)
            bwd[i] += (s.num_layers - c) * comm.backward_ms(f.slots) + c * rerun.backward_ms(f.slots)
            kept, transient = sp_buffer_bytes(spec, sp, recompute, f, s.num_layers, c)
            stored[i] += kept
            peak[i] += kept + transient
    for i, k in enumerate(spec.stage_time):
        fwd[i], bwd[i] = fwd[i] * k, bwd[i] * k
    act = shape[0] * shape[1] // sp * spec.hidden_size * ACT_BYTES.get(spec.cost.dtype, 2) / spec.tp
    weight, deferred = split_backward_costs(spec, layout, f, bwd) if spec.split_backward else ((), ())
    return MicroBatch(
        sample_ids=sample_ids,
        seq_lens=seq_lens,
        layout=layout,
        recompute=recompute,
        forward_ms=tuple(fwd),
        backward_ms=tuple(bwd),
        stored_bytes=tuple(stored),
        peak_bytes=tuple(peak),
        activation_bytes=act,
        shape=shape,
        sp=sp,
        checkpointed=() if whole else counts,
        extrapolated=extrapolated,
        weight_ms=weight,
        deferred_bytes=deferred,
    )


def split_backward_costs(
    spec: PlannerSpec, layout: Layout, f: Features, backward_ms: Sequence[float]
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per stage, a split backward's W time and the bytes held from I's end until W's end; ((), ())
    where the cost model has no table without recompute for the layout to price W from.

    W: ``weight_grad_ms`` (at most the backward). Held: I frees the stage's saved tensors but each
    linear layer's input and output gradient, which its weight gradient multiplies (a linear whose
    backward stashes them, as ``torch.autograd.Function`` can; torch's own split would keep every
    saved tensor). A GPT layer (12h^2 weights) has 7h distinct linear inputs and 9h outputs a
    token, a Llama layer with its 8h/3-wide gated MLP as many: 16h = 4/3 of its weights over h."""
    plain = spec.cost.tables.get((layout, "none", spec.tp))
    if plain is None:
        return (), ()
    per_layer = ACT_BYTES.get(spec.cost.dtype, 2) * f.slots * LINEAR_HELD * spec.cost.params.get("layer", 0.0)
    per_layer /= spec.hidden_size * spec.tp
    scale = spec.stage_time or (1.0,) * spec.pp
    weight = tuple(min(b, weight_grad_ms(plain, f, s) * k) for s, b, k in zip(spec.stages, backward_ms, scale))
    deferred = tuple(s.num_layers * per_layer for s in spec.stages)
    return tuple(weight), tuple(deferred)


def sp_buffer_bytes(
    spec: PlannerSpec, sp: int, recompute: Recompute, f: Features, layers: int, checkpointed: int
) -> tuple[float, float]:
    """(kept, transient) bytes of sequence parallelism's executor buffers on a stage of ``layers``
    layers, ``checkpointed`` of them under ``recompute``: kept by the layers that do not recompute
    (``SequenceParallelCost.layer``), transient in any one. Zeros without sequence parallelism."""
    if sp <= 1:
        return 0.0, 0.0
    comm, rerun = spec.layer_comm(sp, "none"), spec.layer_comm(sp, recompute)
    kept = (layers - checkpointed) * comm.stored_bytes(f.slots, f.attn) + checkpointed * rerun.stored_bytes(
        f.slots, f.attn
    )
    return kept, comm.transient_bytes(f.slots, f.attn) if layers else 0.0


def relax_recompute(
    mbs: tuple[MicroBatch, ...],
    schedule: Schedule,
    sim: SimResult,
    *,
    spec: StepSpec,
    reprice: Reprice | None = None,
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

    ``reprice(mb, mode)``: the micro-batch priced in another mode, None where that is out of the
    measured range; default ``make_micro_batch`` on its lengths (the pair planner passes its own).
    """
    if reprice is None:

        def reprice(old: MicroBatch, rc: Recompute) -> MicroBatch | None:
            mb = repriced(old, spec=spec, recompute=rc)
            return mb if in_range(mb, spec) else None

    budget = [m.budget for m in spec.memory]
    cheaper = {rc: spec.recomputes[: spec.recomputes.index(rc)] for rc in spec.recomputes}
    current = list(mbs)
    stale = False  # sim no longer describes current (changes accepted without simulating)
    for i in sorted(range(len(current)), key=lambda i: -current[i].time_ms):
        for rc in cheaper[current[i].recompute]:
            old = current[i]
            candidate = reprice(old, rc)
            if candidate is None:
                continue
            trial = current[:i] + [candidate] + current[i + 1 :]
            if any(stage_peak_bytes(trial, ops, s) > budget[s] for s, ops in enumerate(schedule.stages)):
                continue
            if all(
                nf <= f and nb <= b
                for nf, f, nb, b in zip(candidate.forward_ms, old.forward_ms, candidate.backward_ms, old.backward_ms)
            ):
                current, stale = trial, True
                break
            if stale:
                sim, stale = simulate(current, schedule, spec.link), False
            result = simulate(trial, schedule, spec.link)
            if result.makespan_ms <= sim.makespan_ms:
                current, sim = trial, result
                break
    return tuple(current), simulate(current, schedule, spec.link) if stale else sim


def recompute_to_fit(mbs: tuple[MicroBatch, ...], schedule: Schedule, *, spec: PlannerSpec) -> tuple[MicroBatch, ...]:
    """Recompute more until every stage fits with ``schedule``'s micro-batches in flight.

    For a host whose pipeline keeps a fixed number of micro-batches in flight (Megatron's 1F1B warms
    stage s up with stages - s - 1 forwards whatever the memory), where the planner would otherwise
    cap them: the partition checks each micro-batch as if those in flight with it were as big, and
    micro-batches of different sizes can still overflow together. On the first stage over its
    budget, the micro-batch storing most there moves to the next stronger mode, until all fit."""
    budget = [m.budget for m in spec.memory]
    stronger = {rc: spec.recomputes[spec.recomputes.index(rc) + 1 :] for rc in spec.recomputes}
    current = list(mbs)
    while over := [s for s, ops in enumerate(schedule.stages) if stage_peak_bytes(current, ops, s) > budget[s]]:
        s = over[0]
        movable = [i for i, m in enumerate(current) if stronger[m.recompute]]
        if not movable:
            raise ValueError(
                f"pipeline stage {s} cannot hold the micro-batches the host's 1F1B keeps in flight there "
                f"({spec.pp - s} at most) even with recompute {', '.join(spec.recomputes)}: raise "
                "cluster.device.memory_mb, allow stronger recompute (microbatching.recompute 'auto'), or plan "
                "fewer tokens per step (microbatching.global_tokens)"
            )
        i = max(movable, key=lambda i: current[i].stored_bytes[s])
        old = current[i]
        current[i] = repriced(old, spec=spec, recompute=stronger[old.recompute][0])
    return tuple(current)


def in_range(mb: MicroBatch, spec: StepSpec) -> bool:
    """Inside what the cost model measured for the micro-batch's layout and recompute mode, or
    beyond it where the cost model allows extrapolation (the micro-batch then says so)."""
    return spec.cost.allow_extrapolation or not mb.extrapolated


def usable(mb: MicroBatch, spec: StepSpec) -> bool:
    """In range, and within every stage's activation budget with the 1F1B in-flight count."""
    return in_range(mb, spec) and all(m.fits(st, pk) for m, st, pk in zip(spec.memory, mb.stored_bytes, mb.peak_bytes))


def checkpointed_layers(mb: MicroBatch, spec: StepSpec) -> tuple[int, ...]:
    """Checkpointed layers per stage (a whole-stage mode: all of them, none under no recompute)."""
    return tuple(mb.checkpointed) if mb.checkpointed else _whole_stage_counts(mb.recompute, spec)


def _whole_stage_counts(recompute: Recompute, spec: StepSpec) -> tuple[int, ...]:
    return tuple(s.num_layers if recompute != "none" else 0 for s in spec.stages)


def same_recompute(plan: StepPlan, *, spec: StepSpec, remake: Remake | None = None) -> StepPlan:
    """With ``spec.same_recompute`` (ZeRO-3), every replica's i-th micro-batch (in run order)
    recomputes alike: ZeRO-3 gathers each module's parameters over every rank in the order the
    modules run, and recompute re-runs modules in backward, so ranks that recompute differently
    desynchronise the gathers (a hang under NCCL). Where they differ, each takes the most
    recompute among them (the strongest mode; its most checkpointed layers, or all of them where
    modes differ): memory only falls, the schedules stay, the replicas are simulated again.
    ``remake(mb, mode, checkpointed)``: the micro-batch priced so (default ``make_micro_batch`` on
    its lengths; the pair planner passes its own)."""
    if not spec.same_recompute or len(plan.replicas) < 2:
        return plan
    if remake is None:

        def remake(mb: MicroBatch, mode: Recompute, counts: list[int] | None) -> MicroBatch:
            return repriced(mb, spec=spec, recompute=mode, checkpointed=counts)

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
            new[r][o[pos]] = remake(mb, mode, counts)
    replicas = tuple(
        replace(r, micro_batches=tuple(m), sim=simulate(m, r.schedule, spec.link)) for r, m in zip(plan.replicas, new)
    )
    return replace(plan, replicas=replicas)


def cheapest_feasible(
    groups: Sequence[Sequence[int]],
    lengths: Sequence[int],
    *,
    spec: PlannerSpec,
    layout: Layout = "packed",
    sp: int = 1,
) -> list[MicroBatch] | None:
    """Each group in its cheapest recompute mode that fits; None if one fits in none."""
    out = []
    for g in groups:
        best = None
        for rc in spec.recomputes:
            mb = make_micro_batch(g, lengths, spec=spec, layout=layout, recompute=rc, sp=sp)
            if usable(mb, spec) and (best is None or mb.time_ms < best.time_ms):
                best = mb
        if best is None:
            return None
        out.append(best)
    return out
