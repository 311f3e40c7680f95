"""Discrete-event simulation of one pipeline replica running a schedule of variable micro-batches.

Each stage has one compute stream that runs its ops in schedule order, and one send stream per
direction. A send stream serialises its transfers, and since a stage produces activations (and
gradients) in its own op order, the link's queue order is that op order: every start time follows
from the dependencies alone, so a worklist over stages replaces a global event queue and the
result does not depend on which stage the worklist advances first.
"""

from __future__ import annotations

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
    num_stages = len(schedule.stages)
    _check_sizes(micro_batches, num_stages)
    # Per-stage columns, so neither twin does attribute look-ups. A split backward's I is the
    # backward less its W.
    fwd_ms = [[mb.forward_ms[s] for mb in micro_batches] for s in range(num_stages)]
    bwd_ms = [[mb.backward_ms[s] for mb in micro_batches] for s in range(num_stages)]
    w_ms = [[mb.weight_ms[s] if mb.weight_ms else 0.0 for mb in micro_batches] for s in range(num_stages)]
    # transfer[s][i]: micro-batch i's activation over link s -> s+1 (its gradient back the same size)
    transfer = [
        [link.transfer_ms(mb.link_bytes[s] if mb.link_bytes else mb.activation_bytes) for mb in micro_batches]
        for s in range(num_stages - 1)
    ]
    kinds = ["".join(op.kind for op in stage) for stage in schedule.stages]
    if core is not None and all(len(k) == len(stage) for k, stage in zip(kinds, schedule.stages)):
        makespan, busy, peak, raw = core.simulate(
            kinds,
            [[op.mb for op in stage] for stage in schedule.stages],
            fwd_ms,
            bwd_ms,
            w_ms,
            [[mb.stored_bytes[s] for mb in micro_batches] for s in range(num_stages)],
            [[mb.peak_bytes[s] for mb in micro_batches] for s in range(num_stages)],
            [[mb.deferred_bytes[s] if mb.deferred_bytes else 0.0 for mb in micro_batches] for s in range(num_stages)],
            transfer,
            [bool(mb.weight_ms) for mb in micro_batches],
            record,
        )
        events = tuple((s, STREAMS[stream], _event_name(stream, kind, i, s), a, b) for s, stream, kind, i, a, b in raw)
    else:
        _check_ops(micro_batches, schedule)
        makespan, busy, events = _run(schedule, fwd_ms, bwd_ms, w_ms, transfer, record)
        peak = [stage_peak_bytes(micro_batches, schedule.stages[s], s) for s in range(num_stages)]
    bubble = 1.0 - sum(busy) / (num_stages * makespan) if makespan > 0 else 0.0
    return SimResult(makespan_ms=makespan, bubble_fraction=bubble, peak_bytes=tuple(peak), events=tuple(events))


STREAMS = ("compute", "send-fwd", "send-bwd")  # a trace event's stream, by the C++ twin's number


def _event_name(stream: int, kind: str, i: int, stage: int) -> str:
    if stream == 0:
        return f"{kind}{i}"
    return f"act {i} -> {stage + 1}" if stream == 1 else f"grad {i} -> {stage - 1}"


def _run(
    schedule: Schedule,
    fwd_ms: list[list[float]],
    bwd_ms: list[list[float]],
    w_ms: list[list[float]],
    transfer: list[list[float]],
    record: bool,
) -> tuple[float, list[float], list[tuple[int, str, str, float, float]]]:
    """The Python twin of ``dyn::simulate``: (makespan, busy ms per stage, trace events)."""
    num_stages = len(schedule.stages)
    m = len(fwd_ms[0])
    last = num_stages - 1
    # Per stage and micro-batch: when the activation (gradient) is available on that stage; None = not yet.
    act_ready: list[list[float | None]] = [[0.0] * m] + [[None] * m for _ in range(last)]
    grad_ready: list[list[float | None]] = [[None] * m for _ in range(num_stages)]
    fwd_done = [[False] * m for _ in range(num_stages)]
    fwd_link_free = [0.0] * num_stages  # stage s -> s+1
    bwd_link_free = [0.0] * num_stages  # stage s -> s-1
    clock = [0.0] * num_stages
    busy = [0.0] * num_stages
    pos = [0] * num_stages
    events: list[tuple[int, str, str, float, float]] = []
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
                events.append((s, "compute", f"{kind}{i}", start, end))
            if kind == "F" and s < last:
                begin = max(end, fwd_link_free[s])
                fwd_link_free[s] = act_ready[s + 1][i] = begin + transfer[s][i]
                sent_fwd = True
                if record:
                    events.append((s, "send-fwd", f"act {i} -> {s + 1}", begin, fwd_link_free[s]))
            elif kind in "BI" and s > 0:
                begin = max(end, bwd_link_free[s])
                bwd_link_free[s] = grad_ready[s - 1][i] = begin + transfer[s - 1][i]
                sent_bwd = True
                if record:
                    events.append((s, "send-bwd", f"grad {i} -> {s - 1}", begin, bwd_link_free[s]))
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
    """Activation peak of ``stage`` running ``ops``: it depends on their order only, not on timing."""
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
        mb = micro_batches[op.mb]
        stored = mb.stored_bytes[stage]
        if op.kind == "W":
            during = alive
            alive -= mb.deferred_bytes[stage]
            steps.append((during, alive))
            continue
        if op.kind == "F":
            alive += stored
        # Grouped so that a lone micro-batch costs exactly its peak: budgets equal to it must fit.
        during = (alive - stored) + mb.peak_bytes[stage]
        if op.kind == "B":
            alive -= stored
        elif op.kind == "I":
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
