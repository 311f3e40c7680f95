"""Pipeline schedules for micro-batches of different cost, and the search that picks one.

With equal micro-batches the order does not matter; with variable ones a long micro-batch
stalls every stage behind it, so the order (and how many micro-batches each stage keeps in
flight) decides the bubble. ``choose_schedule`` simulates a few orders and keeps the fastest
that fits memory. Everything here is deterministic so that every rank derives the same plan.
Under ``zero_bubble`` the chosen schedule is then tried with its backwards split (zero_bubble.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .simulator import simulate, stage_peak_bytes
from .types import LinkSpec, MicroBatch, Op, Schedule, SimResult


def one_f_one_b(
    num_micro_batches: int,
    num_stages: int,
    order: Sequence[int] | None = None,
    max_in_flight: Sequence[int] | None = None,
) -> Schedule:
    """Non-interleaved 1F1B over ``order``; ``max_in_flight[s]`` caps stage s's live micro-batches.

    Every stage runs the micro-batches in the same order, so sends and receives pair up.
    """
    m, k = num_micro_batches, num_stages
    if m < 1 or k < 1:
        raise ValueError(f"need at least one micro-batch and one stage, got {m} and {k}")
    order = tuple(range(m)) if order is None else tuple(int(i) for i in order)
    if sorted(order) != list(range(m)):
        raise ValueError(f"order must be a permutation of 0..{m - 1}, got {order}")
    if max_in_flight is not None and (len(max_in_flight) != k or min(max_in_flight) < 1):
        raise ValueError(f"max_in_flight needs {k} entries, each >= 1; got {tuple(max_in_flight)}")
    forwards = [Op("F", i) for i in order]
    backwards = [Op("B", i) for i in order]
    warmups = []
    warmup = m
    for s in range(k):
        # A stage may not warm up more than its predecessor: it would wait for a forward that the
        # predecessor only runs after the backward this stage has not yet sent back (deadlock).
        warmup = min(warmup, k - s - 1)
        if max_in_flight is not None:
            warmup = min(warmup, max_in_flight[s] - 1)
        warmups.append(warmup)
    # Nor more than one beyond its successor: sends do not buffer (NCCL), so the successor takes
    # only that many activations before it must send its first gradient back, and this stage
    # receives that gradient with its last warm-up forward's send (instructions.py).
    for s in range(k - 2, -1, -1):
        warmups[s] = min(warmups[s], warmups[s + 1] + 1)
    stages = [_stage_ops(forwards, backwards, w) for w in warmups]
    return Schedule(name="1f1b", order=order, stages=tuple(stages))


def choose_schedule(
    micro_batches: Sequence[MicroBatch],
    link: LinkSpec,
    *,
    memory_budget: Sequence[float] | None = None,
    seed: int = 0,
    candidates: int = 8,
    policy: str = "auto",
    capped: bool = True,
) -> tuple[Schedule, SimResult]:
    """The schedule with the shortest simulated makespan whose activation peak fits ``memory_budget``.

    Tries 1F1B in the given order, then reorderings (named "adaptive"); an order that overflows a
    stage's budget is retried with fewer micro-batches in flight there. A tie keeps the earlier
    candidate, so plain 1F1B wins unless something is strictly faster. ``policy`` names the
    orders tried (``SCHEDULES``, the config's ``pipeline.schedule``): "1f1b" keeps the given
    order (memory caps still apply). Without ``capped`` (a host whose schedule cannot hold fewer in
    flight: Megatron's 1F1B) every stage keeps its natural warm-up and an order that overflows a
    budget is not taken; if none fits, the first one's overflow is the error (the planner
    recomputes more first, ``pricing.recompute_to_fit``).
    """
    if policy not in SCHEDULES:
        raise ValueError(f"schedule policy must be one of {', '.join(SCHEDULES)}; got {policy!r}")
    if not micro_batches:
        raise ValueError("no micro-batches to schedule")
    num_stages = len(micro_batches[0].forward_ms)
    if memory_budget is not None and len(memory_budget) != num_stages:
        raise ValueError(f"memory_budget needs {num_stages} entries (one per stage), got {len(memory_budget)}")
    best: tuple[Schedule, SimResult] | None = None
    overflow: ValueError | None = None
    orders = SCHEDULES[policy]([mb.time_ms for mb in micro_batches], seed, candidates)
    if num_stages == 1:
        # one stage runs its micro-batches back to back, one in flight: every order takes the same
        # time (to rounding, far inside the tie margin) and memory, and a tie keeps the first
        orders = orders[:1]
    for n, order in enumerate(orders):
        try:
            schedule, result = _fit(micro_batches, link, order, num_stages, memory_budget, capped=capped)
        except ValueError as e:
            if capped:  # one micro-batch in flight needs the same on every order
                raise
            overflow = overflow or e
            continue
        if best is None or result.makespan_ms < best[1].makespan_ms * (1 - 1e-12):
            name = "1f1b" if n == 0 else "adaptive"
            best = (Schedule(name=name, order=schedule.order, stages=schedule.stages), result)
    if best is None:
        raise overflow
    return best


def _candidate_orders(times: Sequence[float], seed: int, candidates: int) -> list[tuple[int, ...]]:
    """The given order first, then distinct reorderings; the same inputs give the same list."""
    m = len(times)
    longest_first = tuple(sorted(range(m), key=lambda i: -times[i]))
    # Alternating long and short lets a short micro-batch run on one stage while a long one
    # occupies the next, filling the bubble the long one leaves.
    interleaved = tuple(longest_first[j // 2] if j % 2 == 0 else longest_first[m - 1 - j // 2] for j in range(m))
    rng = np.random.default_rng(seed)
    orders = [tuple(range(m)), longest_first, longest_first[::-1], interleaved]
    orders += [tuple(int(i) for i in rng.permutation(m)) for _ in range(candidates)]
    return list(dict.fromkeys(orders))


def _given_order(times: Sequence[float], seed: int, candidates: int) -> list[tuple[int, ...]]:
    """The given order alone: plain 1F1B (memory caps still apply)."""
    return [tuple(range(len(times)))]


# The config's pipeline.schedule names -> the micro-batch orders ``choose_schedule`` tries, given
# order first, from (micro-batch times, seed, random candidates). Adding a policy is one entry;
# tests/test_config.py checks the config's names against these.
SCHEDULES: dict[str, Callable[[Sequence[float], int, int], list[tuple[int, ...]]]] = {
    "1f1b": _given_order,
    "adaptive": _candidate_orders,
    "auto": _candidate_orders,
    "zero_bubble": _candidate_orders,  # and then split (replicas.schedule_replica, zero_bubble.py)
}


def _stage_ops(forwards: list[Op], backwards: list[Op], warmup: int) -> tuple[Op, ...]:
    """``warmup`` forwards, then forward/backward pairs, then the remaining backwards."""
    m = len(forwards)
    ops = forwards[:warmup]
    for i in range(m - warmup):
        ops += (forwards[warmup + i], backwards[i])
    return tuple(ops + backwards[m - warmup :])


def _fit(
    micro_batches: Sequence[MicroBatch],
    link: LinkSpec,
    order: tuple[int, ...],
    num_stages: int,
    memory_budget: Sequence[float] | None,
    *,
    capped: bool = True,
) -> tuple[Schedule, SimResult]:
    """1F1B over ``order`` with, on each stage, as many micro-batches in flight as its budget allows
    (``capped``; else the natural warm-up, which must fit).

    A stage's memory depends only on its own op order, so the cap is found stage by stage without
    simulating; the warmup only shrinks along the pipeline, as in ``one_f_one_b``.
    """
    m = len(micro_batches)
    caps = None
    if memory_budget is not None:
        forwards = [Op("F", i) for i in order]
        backwards = [Op("B", i) for i in order]
        caps = []
        warmup = m
        for s in range(num_stages):
            warmup = min(warmup, num_stages - s - 1)
            while (need := stage_peak_bytes(micro_batches, _stage_ops(forwards, backwards, warmup), s)) > memory_budget[
                s
            ]:
                if warmup == 0 or not capped:  # one micro-batch in flight needs the same on every order
                    held = (
                        f"{warmup + 1} micro-batches in flight, as the host's 1F1B holds"
                        if not capped
                        else ("one micro-batch in flight")
                    )
                    raise ValueError(
                        f"stage {s} exceeds its activation memory budget by {need - memory_budget[s]:.0f} bytes "
                        f"even with {held} (needs {need:.0f}, budget {memory_budget[s]:.0f})"
                    )
                warmup -= 1
            caps.append(warmup + 1)
    schedule = one_f_one_b(m, num_stages, order, caps)
    return schedule, simulate(micro_batches, schedule, link)
