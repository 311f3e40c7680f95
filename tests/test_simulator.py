import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dyn_plugin.plan.steps.schedule import choose_schedule, one_f_one_b
from dyn_plugin.plan.steps.simulator import memory_timeline, simulate, stage_peak_bytes
from dyn_plugin.plan.steps.trace import chrome_trace, write_chrome_trace
from dyn_plugin.plan.steps.types import LinkSpec, MicroBatch, Op, Schedule

FREE = LinkSpec(gb_per_s=float("inf"), latency_us=0.0)


def mb(f, b, stages, *, stored=0.0, peak=None, act=0.0, lens=(8,)):
    """A micro-batch with the same cost on every stage (per-stage tuples pass through)."""
    per = lambda x: tuple(x) if isinstance(x, (tuple, list)) else (float(x),) * stages  # noqa: E731
    return MicroBatch(
        sample_ids=tuple(range(len(lens))),
        seq_lens=tuple(lens),
        layout="packed",
        recompute="none",
        forward_ms=per(f),
        backward_ms=per(b),
        stored_bytes=per(stored),
        peak_bytes=per(stored if peak is None else peak),
        activation_bytes=act,
        shape=(1, sum(lens)),
    )


def schedule(*stages):
    return Schedule("manual", (), tuple(tuple(Op(o[0], int(o[1:])) for o in ops.split()) for ops in stages))


def test_one_stage_is_the_sum_of_times():
    mbs = [mb(1, 2, 1), mb(3, 5, 1), mb(0.5, 0.25, 1)]
    r = simulate(mbs, one_f_one_b(3, 1), FREE)
    assert r.makespan_ms == pytest.approx(11.75)
    assert r.bubble_fraction == pytest.approx(0.0)


def test_two_stages_two_equal_micro_batches():
    # s0: F0 0-1, F1 1-2, B0 4-6, B1 7-9; s1: F0 1-2, B0 2-4, F1 4-5, B1 5-7
    r = simulate([mb(1, 2, 2)] * 2, one_f_one_b(2, 2), FREE)
    assert r.makespan_ms == pytest.approx(9.0)
    assert r.bubble_fraction == pytest.approx(1 / 3)


@pytest.mark.parametrize("m,k", [(1, 1), (4, 2), (8, 4), (3, 5), (16, 4)])
def test_equal_micro_batches_match_the_1f1b_formula(m, k):
    f, b = 1.5, 2.5
    r = simulate([mb(f, b, k)] * m, one_f_one_b(m, k), FREE)
    assert r.makespan_ms == pytest.approx((m + k - 1) * (f + b))
    assert r.bubble_fraction == pytest.approx((k - 1) / (m + k - 1))


def test_communication_delays_add_up():
    link = LinkSpec(gb_per_s=1.0, latency_us=1000.0)  # 1 ms latency + 1 ms per MB
    one = mb(1, 2, 2, act=2e6)  # 3 ms per transfer
    r = simulate([one], one_f_one_b(1, 2), link)
    assert r.makespan_ms == pytest.approx(1 + 3 + 1 + 2 + 3 + 2)


def test_transfers_on_one_link_are_serialised():
    link = LinkSpec(gb_per_s=1.0, latency_us=0.0)
    mbs = [mb(1, 2, 2, act=5e6)] * 2  # 5 ms per transfer, longer than the compute
    # acts 1-6, 6-11 (not 2-7); s1: F0 6-7 B0 7-9 F1 11-12 B1 12-14; grads 9-14, 14-19; s0: B0 14-16, B1 19-21
    r = simulate(mbs, one_f_one_b(2, 2), link, record=True)
    assert r.makespan_ms == pytest.approx(21.0)
    sends = [(e[2], e[3], e[4]) for e in r.events if e[1] != "compute"]
    assert sends == [
        ("act 0 -> 1", 1.0, 6.0),
        ("act 1 -> 1", 6.0, 11.0),
        ("grad 0 -> 0", 9.0, 14.0),
        ("grad 1 -> 0", 14.0, 19.0),
    ]


def test_memory_peak_is_in_flight_stored_plus_transient():
    stored, peak = (10.0, 20.0, 30.0), (15.0, 40.0, 31.0)
    mbs = [mb(1, 1, 2, stored=s, peak=p) for s, p in zip(stored, peak)]
    r = simulate(mbs, one_f_one_b(3, 2), FREE, record=True)
    # stage 0 runs F0 F1 B0 F2 B1 B2: during B1, mb 1 and 2 are stored and B1's transient is live
    assert r.peak_bytes[0] == pytest.approx(20 + 30 + (40 - 20))
    assert r.peak_bytes[1] == pytest.approx(max(peak))  # F/B alternate: one micro-batch at a time
    timeline = memory_timeline(mbs, r)
    for s in range(2):
        values = [v for stage, _, v in timeline if stage == s]
        assert max(values) == pytest.approx(r.peak_bytes[s])
        assert values[-1] == pytest.approx(0.0)


@pytest.mark.parametrize(
    "stages, message",
    [
        (("F0 B0 F1 B1", "F0 B0 B1 F1"), "B1 comes before F1"),
        (("F0 B0 F1", "F0 B0 F1 B1"), "B1 is missing"),
        (("F0 B0 F0 F1 B1", "F0 B0 F1 B1"), "F0 appears twice"),
        (("F0 B0 F2 B2", "F0 B0 F1 B1"), "unknown op F2"),
        (("F0 B0 F1 B1", "F1 B1 F0 B0"), "cycle"),
    ],
)
def test_invalid_schedules_raise(stages, message):
    with pytest.raises(ValueError, match=message):
        simulate([mb(1, 1, 2)] * 2, schedule(*stages), FREE)


def test_later_stage_warming_up_more_than_its_predecessor_deadlocks():
    # stage 1 holds two forwards before a backward, but stage 0 runs F1 only after B0
    with pytest.raises(ValueError, match="cycle"):
        simulate([mb(1, 1, 3)] * 3, schedule("F0 B0 F1 B1 F2 B2", "F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"), FREE)


def test_micro_batch_priced_for_other_stage_count():
    with pytest.raises(ValueError, match="priced for 3 stages"):
        simulate([mb(1, 1, 3)], one_f_one_b(1, 2), FREE)


def test_recorded_events_cover_every_op_once():
    mbs = [mb(1 + i, 2 * (1 + i), 3, act=1e6) for i in range(4)]
    r = simulate(mbs, one_f_one_b(4, 3), LinkSpec(gb_per_s=10), record=True)
    compute = [(s, name) for s, stream, name, _, _ in r.events if stream == "compute"]
    assert sorted(compute) == sorted((s, f"{k}{i}") for s in range(3) for k in "FB" for i in range(4))
    assert max(e[4] for e in r.events) == pytest.approx(r.makespan_ms)
    assert not simulate(mbs, one_f_one_b(4, 3), LinkSpec(gb_per_s=10)).events  # only when asked


def test_chrome_trace(tmp_path):
    mbs = [mb(1 + i, 2 * (1 + i), 2, stored=100.0, act=1e6, lens=(3, 5)) for i in range(3)]
    results = [
        simulate(mbs, one_f_one_b(3, 2, order=order), LinkSpec(gb_per_s=10), record=True)
        for order in ((0, 1, 2), (2, 1, 0))
    ]
    traces = [chrome_trace(r, mbs, title="step 7", replica=n) for n, r in enumerate(results)]
    path = tmp_path / "trace.json"
    write_chrome_trace(path, traces)
    doc = json.loads(path.read_text())
    assert doc["displayTimeUnit"] == "ms"
    for n, r in enumerate(results):
        spans = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == n]
        assert len(spans) == len(r.events)
        names = {(e["tid"], e["name"]) for e in spans}
        assert len(names) == len(spans)  # every op and transfer once
        by_name = {(e["tid"] // 3, e["cat"], e["name"]): e for e in spans}
        for stage, stream, name, start, end in r.events:
            e = by_name[(stage, stream, name)]
            assert e["ts"] == pytest.approx(start * 1e3) and e["dur"] == pytest.approx((end - start) * 1e3)
        assert spans[0]["args"] == {
            "sequences": 2,
            "real_tokens": 8,
            "shape": [1, 8],
            "layout": "packed",
            "recompute": "none",
        }
    threads = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name" and e["pid"] == 0}
    assert {"stage 0 compute", "stage 1 send-bwd"} <= threads
    assert any(e["ph"] == "C" and e["name"] == "stage 1 activations" for e in doc["traceEvents"])
    assert "act 0 -> 1" in {e["name"] for e in doc["traceEvents"]}
    with pytest.raises(ValueError, match="replica"):
        write_chrome_trace(path, [traces[0], traces[0]])
    with pytest.raises(ValueError, match="record=True"):
        chrome_trace(simulate(mbs, one_f_one_b(3, 2), FREE), mbs)


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 4),
    times=st.lists(st.tuples(st.floats(0.1, 20.0), st.floats(0.1, 40.0), st.floats(0.0, 4e6)), min_size=1, max_size=7),
    seed=st.integers(0, 3),
)
def test_adaptive_is_never_worse_than_1f1b(k, times, seed):
    mbs = [mb(f, b, k, act=a) for f, b, a in times]
    link = LinkSpec(gb_per_s=2.0)
    chosen, result = choose_schedule(mbs, link, seed=seed, candidates=3)
    plain = simulate(mbs, one_f_one_b(len(mbs), k), link)
    assert result.makespan_ms <= plain.makespan_ms
    assert simulate(mbs, chosen, link).makespan_ms == result.makespan_ms


def _random_replica(rng, stages: int, m: int):
    """Micro-batches of random costs (some with their backward split priced) on a random link, and a
    schedule: 1F1B, its zero-bubble split where every backward is priced for one, or its stages'
    ops shuffled (most of those cannot run)."""
    split = rng.random() < 0.6
    mbs = []
    for _ in range(m):
        per = lambda lo, hi: tuple(float(x) for x in rng.uniform(lo, hi, stages))  # noqa: E731
        bwd = per(0.5, 8)
        stored = per(0, 1e6)
        priced = split or rng.random() < 0.3
        mbs.append(
            replace(
                mb(per(0.2, 4), bwd, stages, stored=stored, peak=tuple(s + p for s, p in zip(stored, per(0, 1e5)))),
                activation_bytes=float(rng.uniform(0, 1e7)),
                weight_ms=tuple(b * w for b, w in zip(bwd, per(0, 0.7))) if priced else (),
                deferred_bytes=per(0, 1e6) if priced else (),
            )
        )
    link = LinkSpec(gb_per_s=float(rng.uniform(0.5, 50)), latency_us=float(rng.uniform(0, 30)))
    sched = one_f_one_b(m, stages)
    if split:
        from dyn_plugin.plan.steps.zero_bubble import split_backward

        sched = split_backward(mbs, sched, link)[0]
    if rng.random() < 0.3:
        sched = Schedule(
            "shuffled", (), tuple(tuple(rng.permutation(np.array(ops, dtype=object))) for ops in sched.stages)
        )
    return mbs, sched, link


def _outcome(mbs, sched, link):
    """The simulation (or its error) and each stage's peak as the planner's memory checks ask it."""
    try:
        result = simulate(mbs, sched, link, record=True)
    except ValueError as exc:
        result = f"ValueError: {exc}"
    peaks = []
    for s, ops in enumerate(sched.stages):
        try:
            peaks.append(stage_peak_bytes(mbs, ops, s))
        except IndexError:  # ops the simulation refuses (the errors' words are its own)
            peaks.append("IndexError")
    return result, tuple(peaks)


@pytest.mark.native
@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), stages=st.integers(1, 5), m=st.integers(1, 8))
def test_native_equals_python_exactly(seed, stages, m):
    """The C++ twin (csrc/simulator.hpp) gives the Python's makespan, bubble, peaks and events bit for
    bit, and its errors word for word, on split and whole backwards and on schedules that cannot run."""
    import dyn_plugin.plan.steps.simulator as simulator

    mbs, sched, link = _random_replica(np.random.default_rng(seed), stages, m)
    native = _outcome(mbs, sched, link)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(simulator, "core", None)
        python = _outcome(mbs, sched, link)
    assert native == python


@pytest.mark.native
def test_native_refuses_what_the_python_refuses():
    """Op checks word for word: a duplicate, a W before its I, a missing op, a split nobody priced."""
    import dyn_plugin.plan.steps.simulator as simulator

    whole = [mb(1, 2, 2), mb(1, 2, 2)]
    split = [replace(m, weight_ms=(1.0, 1.0), deferred_bytes=(0.0, 0.0)) for m in whole]
    cases = [
        (whole, schedule("F0 F1 B0 B1 B1", "F0 F1 B0 B1")),
        (split, schedule("F0 F1 I0 W0 I1 W1", "F0 F1 W0 I0 I1 W1")),
        (whole, schedule("F0 F1 B0", "F0 F1 B0 B1")),
        (split, schedule("F0 F1 I0 B0 I1 W1", "F0 F1 I0 W0 I1 W1")),
        (whole, schedule("F0 F1 I0 B1", "F0 F1 B0 B1")),
        (whole, schedule("F0 F2 B0", "F0 B0")),
        (whole, schedule("B0 F0 F1 B1", "F0 F1 B0 B1")),
        (whole, schedule("F0 B0 F1 B1", "F1 F0 B0 B1")),
    ]
    for mbs, sched in cases:
        native = _outcome(mbs, sched, FREE)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(simulator, "core", None)
            python = _outcome(mbs, sched, FREE)
        assert isinstance(native[0], str) and native == python
