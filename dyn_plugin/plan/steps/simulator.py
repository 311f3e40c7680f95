"""Discrete-event simulation of one pipeline replica running a schedule of variable micro-batches.

Each stage has one compute stream that runs its ops in schedule order, and one send stream per
direction. A send stream serialises its transfers, and since a stage produces activations (and
gradients) in its own op order, the link's queue order is that op order: every start time follows
from the dependencies alone, so a worklist over stages replaces a global event queue and the
result does not depend on which stage the worklist advances first.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ...cost.native import core
from .types import LinkSpec, MicroBatch, Op, Schedule, SimResult


def simulate(
    micro_batches: Sequence[MicroBatch], schedule: Schedule, link: LinkSpec, *, record: bool = False
) -> SimResult:
    """Makespan, bubble and per-stage activation peak of ``schedule``; ``record`` adds trace events.

    Raises ValueError for a schedule that cannot run: an op missing or duplicated, a backward
    before its forward on a stage, or stages waiting on each other in a cycle. Runs in C++
    (csrc/simulator.hpp, bit-identical) where the extension is built and every op kind is one letter.
    """
    result, raw = _simulated(micro_batches, schedule, link, record)
    events = tuple((s, STREAMS[stream], _event_name(stream, kind, i, s), a, b) for s, stream, kind, i, a, b in raw)
    return replace(result, events=events) if record else result


def op_times(
    micro_batches: Sequence[MicroBatch], schedule: Schedule, link: LinkSpec
) -> tuple[SimResult, list[list[tuple[float, float]]]]:
    """``simulate``'s result (no events) and, per stage, each compute op's (start, end) in its op
    order: what a search that moves ops into the gaps reads, without naming every event."""
    result, raw = _simulated(micro_batches, schedule, link, True)
    times: list[list[tuple[float, float]]] = [[] for _ in schedule.stages]
    for s, stream, _, _, start, end in raw:
        if stream == 0:
            times[s].append((start, end))
    return result, times


def _simulated(
    micro_batches: Sequence[MicroBatch], schedule: Schedule, link: LinkSpec, record: bool
) -> tuple[SimResult, list[tuple[int, int, str, int, float, float]]]:
    """The result without events, and the events as (stage, stream number, kind, micro-batch, start, end)."""
    num_stages = len(schedule.stages)
    _check_sizes(micro_batches, num_stages)
    encoded = _encoded(schedule.stages)
    if encoded is not None:
        makespan, busy, peak, raw = core.simulate(
            *encoded, _rows(micro_batches), link.gb_per_s, link.latency_us, record
        )
    else:
        _check_ops(micro_batches, schedule)
        makespan, busy, raw = _run(micro_batches, schedule, link, record)
        peak = [stage_peak_bytes(micro_batches, schedule.stages[s], s) for s in range(num_stages)]
    bubble = 1.0 - sum(busy) / (num_stages * makespan) if makespan > 0 else 0.0
    return SimResult(makespan_ms=makespan, bubble_fraction=bubble, peak_bytes=tuple(peak)), raw


def _encoded(stages: Sequence[Sequence[Op]]) -> tuple[list[str], list[list[int]]] | None:
    """Each stage's op kinds as one string and its micro-batches, as the C++ twin takes them; None
    without the extension or where a kind is not one letter (the Python twin then says what is wrong)."""
    if core is None:
        return None
    kinds = ["".join([op.kind for op in ops]) for ops in stages]
    if any(len(k) != len(ops) for k, ops in zip(kinds, stages)):
        return None
    return kinds, [[op.mb for op in ops] for ops in stages]


def _rows(micro_batches: Sequence[MicroBatch]) -> list[tuple]:
    """Each micro-batch as the C++ twin takes it."""
    return [
        (
            mb.forward_ms,
            mb.backward_ms,
            mb.weight_ms,
            mb.stored_bytes,
            mb.peak_bytes,
            mb.deferred_bytes,
            mb.activation_bytes,
            mb.link_bytes,
        )
        for mb in micro_batches
    ]


STREAMS = ("compute", "send-fwd", "send-bwd")  # a trace event's stream, by its number in _simulated (trace.py's too)


def _event_name(stream: int, kind: str, i: int, stage: int) -> str:
    if stream == 0:
        return f"{kind}{i}"
    return f"act {i} -> {stage + 1}" if stream == 1 else f"grad {i} -> {stage - 1}"


def _run(
    micro_batches: Sequence[MicroBatch], schedule: Schedule, link: LinkSpec, record: bool
) -> tuple[float, list[float], list[tuple[int, int, str, int, float, float]]]:
    """The Python twin of ``dyn::simulate``: (makespan, busy ms per stage, events as ``_simulated`` has them)."""
    num_stages = len(schedule.stages)
    m = len(micro_batches)
    last = num_stages - 1
    # transfer[s][i]: micro-batch i's activation over link s -> s+1 (its gradient back the same size)
    transfer = [
        [link.transfer_ms(mb.link_bytes[s] if mb.link_bytes else mb.activation_bytes) for mb in micro_batches]
        for s in range(last)
    ]
    # Per-stage columns, so the loop below does no attribute look-ups. A split backward's I is the
    # backward less its W.
    fwd_ms = [[mb.forward_ms[s] for mb in micro_batches] for s in range(num_stages)]
    bwd_ms = [[mb.backward_ms[s] for mb in micro_batches] for s in range(num_stages)]
    w_ms = [[mb.weight_ms[s] if mb.weight_ms else 0.0 for mb in micro_batches] for s in range(num_stages)]
    # Per stage and micro-batch: when the activation (gradient) is available on that stage; None = not yet.
    act_ready: list[list[float | None]] = [[0.0] * m] + [[None] * m for _ in range(last)]
    grad_ready: list[list[float | None]] = [[None] * m for _ in range(num_stages)]
    fwd_done = [[False] * m for _ in range(num_stages)]
    fwd_link_free = [0.0] * num_stages  # stage s -> s+1
    bwd_link_free = [0.0] * num_stages  # stage s -> s-1
    clock = [0.0] * num_stages
    busy = [0.0] * num_stages
    pos = [0] * num_stages
    events: list[tuple[int, int, str, int, float, float]] = []
    ops = [[(op.kind, op.mb) for op in stage] for stage in schedule.stages]

    pending = list(range(num_stages - 1, -1, -1))
    queued = [True] * num_stages
    while pending:
        s = pending.pop()
        queued[s] = False
        stage_ops = ops[s]
        sent_fwd = sent_bwd = False
        while pos[s] < len(stage_ops):
            kind, i = stage_ops[pos[s]]
            if kind == "F":
                ready = act_ready[s][i]
                if ready is None:
                    break
                start = max(clock[s], ready)
                end = start + fwd_ms[s][i]
                fwd_done[s][i] = True
            elif kind == "W":  # its I ran earlier on this stage (_check_ops): nothing to wait for
                start = clock[s]
                end = start + w_ms[s][i]
            else:
                if not fwd_done[s][i]:
                    raise ValueError(f"stage {s}: op {kind}{i} comes before F{i}")
                # The last stage's backward follows its own forward, already behind clock[s].
                ready = clock[s] if s == last else grad_ready[s][i]
                if ready is None:
                    break
                start = max(clock[s], ready)
                end = start + bwd_ms[s][i] - (w_ms[s][i] if kind == "I" else 0.0)
            busy[s] += end - start
            clock[s] = end
            pos[s] += 1
            if record:
                events.append((s, 0, kind, i, start, end))
            if kind == "F" and s < last:
                begin = max(end, fwd_link_free[s])
                fwd_link_free[s] = act_ready[s + 1][i] = begin + transfer[s][i]
                sent_fwd = True
                if record:
                    events.append((s, 1, kind, i, begin, fwd_link_free[s]))
            elif kind in "BI" and s > 0:
                begin = max(end, bwd_link_free[s])
                bwd_link_free[s] = grad_ready[s - 1][i] = begin + transfer[s - 1][i]
                sent_bwd = True
                if record:
                    events.append((s, 2, kind, i, begin, bwd_link_free[s]))
        # Wake a neighbour only when this stage handed it something it may be waiting for.
        for peer, sent in ((s + 1, sent_fwd), (s - 1, sent_bwd)):
            if sent and not queued[peer] and pos[peer] < len(ops[peer]):
                queued[peer] = True
                pending.append(peer)

    blocked = [s for s in range(num_stages) if pos[s] < len(ops[s])]
    if blocked:
        waits = ", ".join(f"stage {s} at {ops[s][pos[s]][0]}{ops[s][pos[s]][1]}" for s in blocked)
        raise ValueError(f"schedule deadlocks: stages wait on each other in a cycle ({waits})")

    return max(clock), busy, events


def stage_peak_bytes(micro_batches: Sequence[MicroBatch], ops: Sequence[Op], stage: int) -> float:
    """Activation peak of ``stage`` running ``ops``: it depends on their order only, not on timing.
    (Python alone: handing one stage's ops and micro-batches to C++ costs more than this loop.)"""
    return max((during for during, _ in memory_steps(micro_batches, ops, stage)), default=0.0)


def memory_timeline(micro_batches: Sequence[MicroBatch], result: SimResult) -> list[tuple[int, float, float]]:
    """(stage, time_ms, activation bytes) at the start and end of every op of a recorded result."""
    by_stage: dict[int, list[tuple[Op, float, float]]] = {}
    for stage, stream, name, start, end in result.events:
        if stream == "compute":
            by_stage.setdefault(stage, []).append((Op(name[0], int(name[1:])), start, end))
    samples = []
    for stage, timed in sorted(by_stage.items()):
        steps = memory_steps(micro_batches, [op for op, _, _ in timed], stage)
        for (_, start, end), (during, after) in zip(timed, steps):
            samples += [(stage, start, during), (stage, end, after)]
    return samples


def memory_steps(micro_batches: Sequence[MicroBatch], ops: Sequence[Op], stage: int) -> list[tuple[float, float]]:
    """Per op: bytes while it runs and after it ends.

    F(mb) allocates mb's stored bytes at its start, kept until B(mb) on this stage ends; an op's
    transient (peak - stored) lives while it runs. A split backward holds, from I's end until W's,
    the deferred bytes in place of the stored ones (W's own gradients are model states).
    """
    alive = 0.0
    steps = []
    for op in ops:
        kind, mb = op.kind, micro_batches[op.mb]
        stored = mb.stored_bytes[stage]
        if kind == "W":
            during = alive
            alive -= mb.deferred_bytes[stage]
            steps.append((during, alive))
            continue
        if kind == "F":
            alive += stored
        # Grouped so that a lone micro-batch costs exactly its peak: budgets equal to it must fit.
        during = (alive - stored) + mb.peak_bytes[stage]
        if kind == "B":
            alive -= stored
        elif kind == "I":
            alive += mb.deferred_bytes[stage] - stored
        steps.append((during, alive))
    return steps


def _check_sizes(micro_batches: Sequence[MicroBatch], num_stages: int) -> None:
    if num_stages == 0:
        raise ValueError("schedule has no stages")
    for i, mb in enumerate(micro_batches):
        if not len(mb.forward_ms) == len(mb.backward_ms) == len(mb.stored_bytes) == len(mb.peak_bytes) == num_stages:
            raise ValueError(f"micro-batch {i} is priced for {len(mb.forward_ms)} stages, schedule has {num_stages}")
        if mb.link_bytes and len(mb.link_bytes) != num_stages - 1:
            raise ValueError(
                f"micro-batch {i} sends over {len(mb.link_bytes)} links, {num_stages} stages have {num_stages - 1}"
            )


def _check_ops(micro_batches: Sequence[MicroBatch], schedule: Schedule) -> None:
    """The Python twin of ``dyn::detail::check_ops``: every op known, once, in a possible order."""
    for s, stage in enumerate(schedule.stages):
        seen: dict[int, str] = {}  # micro-batch -> its kinds so far on this stage, in order
        for op in stage:
            if op.kind not in ("F", "B", "I", "W") or not 0 <= op.mb < len(micro_batches):
                raise ValueError(f"stage {s}: unknown op {op.kind}{op.mb}")
            had = seen.get(op.mb, "")
            if op.kind in had:
                raise ValueError(f"stage {s}: op {op.kind}{op.mb} appears twice")
            if op.kind == "W" and "I" not in had:
                raise ValueError(f"stage {s}: op W{op.mb} comes before I{op.mb}")
            if op.kind in "BI" and ("B" in had or "I" in had):
                raise ValueError(f"stage {s}: micro-batch {op.mb} runs both B and I (a backward is whole or split)")
            if op.kind == "I" and not micro_batches[op.mb].weight_ms:
                raise ValueError(f"stage {s}: micro-batch {op.mb}'s split backward is not priced (no weight_ms)")
            seen[op.mb] = had + op.kind
        for i in range(len(micro_batches)):
            had = seen.get(i, "")
            missing = next((k for k in "FB" if k not in had and not (k == "B" and "I" in had)), None)
            if missing is None and "I" in had and "W" not in had:
                missing = "W"
            if missing:
                raise ValueError(f"stage {s}: op {missing}{i} is missing")
