import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dyn_plugin.plan.steps.schedule import choose_schedule, one_f_one_b
from dyn_plugin.plan.steps.simulator import simulate
from dyn_plugin.plan.steps.types import LinkSpec, MicroBatch

LINK = LinkSpec(gb_per_s=25.0)


def mb(time, stages, *, stored=0.0, peak=None):
    """Forward ``time``, backward twice that, on every stage."""
    return MicroBatch(
        sample_ids=(0,),
        seq_lens=(8,),
        layout="padded",
        recompute="none",
        forward_ms=(time,) * stages,
        backward_ms=(2 * time,) * stages,
        stored_bytes=(stored,) * stages,
        peak_bytes=((stored if peak is None else peak),) * stages,
        activation_bytes=1e5,
        shape=(1, 8),
    )


def ops(stage):
    return " ".join(f"{op.kind}{op.mb}" for op in stage)


def in_flight(stage):
    """Most micro-batches between their forward and backward at once."""
    live = most = 0
    for op in stage:
        live += 1 if op.kind == "F" else -1
        most = max(most, live)
    return most


def test_1f1b_warms_up_then_alternates_then_drains():
    s = one_f_one_b(4, 3)
    assert s.name == "1f1b" and s.order == (0, 1, 2, 3)
    assert [ops(stage) for stage in s.stages] == [
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]
    assert ops(one_f_one_b(2, 4).stages[0]) == "F0 F1 B0 B1"  # fewer micro-batches than stages


def test_1f1b_follows_the_order_on_every_stage():
    s = one_f_one_b(3, 2, order=[2, 0, 1])
    assert [ops(stage) for stage in s.stages] == ["F2 F0 B2 F1 B0 B1", "F2 B2 F0 B0 F1 B1"]


def test_max_in_flight_caps_a_stage_and_the_stages_after_it():
    s = one_f_one_b(6, 4, max_in_flight=[4, 2, 3, 1])
    # stage 2 could hold 2 (its natural warmup is 1), but stays at stage 1's cap of 2 anyway;
    # stage 0 may hold 4 but keeps 3: one more than stage 1, or its sends would wait (unbuffered)
    assert [in_flight(stage) for stage in s.stages] == [3, 2, 2, 1]
    s = one_f_one_b(6, 4, max_in_flight=[1, 4, 4, 4])
    assert [in_flight(stage) for stage in s.stages] == [1, 1, 1, 1]


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 2), "at least one"),
        ((3, 2, [0, 1, 1]), "permutation"),
        ((3, 2, None, [1]), "max_in_flight"),
        ((3, 2, None, [0, 1]), ">= 1"),
    ],
)
def test_1f1b_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        one_f_one_b(*args)


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 8),
    k=st.integers(1, 5),
    caps=st.lists(st.integers(1, 6), min_size=5, max_size=5),
    data=st.data(),
)
def test_capped_1f1b_never_deadlocks_and_respects_caps(m, k, caps, data):
    order = data.draw(st.permutations(range(m)))
    s = one_f_one_b(m, k, order=order, max_in_flight=caps[:k])
    for stage, cap in zip(s.stages, caps):
        assert in_flight(stage) <= cap
    simulate([mb(1.0, k)] * m, s, LINK)  # raises on a deadlock


def test_equal_micro_batches_keep_plain_1f1b():
    schedule, result = choose_schedule([mb(2.0, 4)] * 8, LINK)
    assert schedule.name == "1f1b" and schedule.order == tuple(range(8))
    assert result == simulate([mb(2.0, 4)] * 8, one_f_one_b(8, 4), LINK)


def test_reordering_beats_1f1b_on_variable_micro_batches():
    mbs = [mb(t, 4) for t in (1, 1, 1, 1, 1, 1, 1, 20)]  # the long one last leaves a long drain
    schedule, result = choose_schedule(mbs, LINK)
    assert schedule.name == "adaptive"
    assert result.makespan_ms < simulate(mbs, one_f_one_b(8, 4), LINK).makespan_ms
    assert result == simulate(mbs, schedule, LINK)


def test_choose_schedule_is_deterministic():
    mbs = [mb(t, 3) for t in (5, 1, 3, 9, 2, 2, 7)]
    first = choose_schedule(mbs, LINK, seed=3)
    assert choose_schedule(mbs, LINK, seed=3) == first
    assert choose_schedule(list(mbs), LINK, seed=3, candidates=8) == first


def test_memory_budget_caps_micro_batches_in_flight():
    mbs = [mb(1.0, 4, stored=100.0, peak=150.0)] * 8
    free, _ = choose_schedule(mbs, LINK)
    assert [in_flight(s) for s in free.stages] == [4, 3, 2, 1]
    budget = [260.0, 1000.0, 1000.0, 1000.0]  # stage 0 fits two stored plus one transient
    schedule, result = choose_schedule(mbs, LINK, memory_budget=budget)
    assert [in_flight(s) for s in schedule.stages] == [2, 2, 2, 1]
    assert all(p <= b for p, b in zip(result.peak_bytes, budget))
    assert result.makespan_ms > simulate(mbs, free, LINK).makespan_ms


def test_impossible_budget_names_the_stage_and_the_excess():
    mbs = [mb(1.0, 3, stored=100.0, peak=150.0)] * 4
    with pytest.raises(ValueError, match=r"stage 1 exceeds .* by 30 bytes"):
        choose_schedule(mbs, LINK, memory_budget=[1000.0, 120.0, 1000.0])
    with pytest.raises(ValueError, match="one per stage"):
        choose_schedule(mbs, LINK, memory_budget=[1000.0])


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 4),
    mbs=st.lists(st.tuples(st.floats(0.5, 10.0), st.floats(1.0, 100.0), st.floats(0.0, 50.0)), min_size=1, max_size=8),
    slack=st.floats(1.0, 4.0),
)
def test_chosen_schedule_fits_any_feasible_budget(k, mbs, slack):
    micro = [mb(t, k, stored=s, peak=s + extra) for t, s, extra in mbs]
    budget = [max(m.peak_bytes[0] for m in micro) * slack] * k
    schedule, result = choose_schedule(micro, LINK, memory_budget=budget, candidates=2)
    assert all(p <= b for p, b in zip(result.peak_bytes, budget))
    assert result == simulate(micro, schedule, LINK)


def test_budget_equal_to_the_largest_peak_fits_despite_rounding():
    # 1.9 + (3.0 - 1.9) != 3.0 in floating point
    schedule, result = choose_schedule([mb(1.0, 2, stored=1.9, peak=3.0)] * 3, LINK, memory_budget=[3.0, 3.0])
    assert result.peak_bytes == (3.0, 3.0)
