"""Stage 1 dispatch: a valid assignment, C++ equal to Python, never worse than the seed's rule,
near the optimum on tiny inputs."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dyn_plugin.cost.native import core
from dyn_plugin.lengths.io import load_lengths
from dyn_plugin.plan.assignment.dispatch import dispatch, seed_dispatch
from dyn_plugin.plan.steps.microbatch import InfeasibleError

MIXTURE = load_lengths("mixture")


def benchmark_like(seed: int, n: int, counts: tuple[int, ...], fill: tuple[float, ...]):
    """Lengths from the bundled mixture capped at 32768; kind t is 2**t times wider: faster per
    token (a*s^2 + b*s, sublinear speed-up) and holding 4096 * 2**t tokens."""
    rng = np.random.default_rng(seed)
    lens = np.minimum(rng.choice(MIXTURE, n), 32768)
    base = lens * 1e-3 + (lens / 1000.0) ** 2 * 0.05
    times = np.array([base / 2**t * 1.1**t for t in range(len(counts))])
    for t in range(len(counts)):
        times[t, lens > 4096 * 2**t] = np.inf
    return times, np.repeat(np.arange(len(counts)), counts), np.array(fill), lens


def random_input(rng: np.random.Generator, n: int, pipelines: int, kinds: int, *, ties: bool):
    """Times in few distinct values (``ties``) or continuous, some inf; every sequence fits the
    last kind, which some pipeline has."""
    times = rng.integers(1, 6, (kinds, n)).astype(float) if ties else rng.random((kinds, n)) * 10
    times[rng.random((kinds, n)) < 0.3] = np.inf
    times[-1] = np.where(np.isinf(times[-1]), 7.0, times[-1])
    kind_of = np.concatenate([[kinds - 1], rng.integers(0, kinds, pipelines - 1)])
    fill = rng.integers(0, 4, kinds).astype(float) if ties else rng.random(kinds) * 3
    return times, kind_of, fill, rng.integers(1, 50 if ties else 10**6, n)


def check_valid(d, times, kinds, fill):
    ids = sorted(i for m in d.members for i in m)
    assert ids == list(range(times.shape[1])), "every sequence exactly once"
    assert len(d.members) == len(d.finish_ms) == len(kinds)
    for p, m in enumerate(d.members):
        t = times[kinds[p], list(m)]
        assert np.isfinite(t).all(), "a sequence on a kind it does not fit"
        want = t.sum() + fill[kinds[p]] * t.max() if m else 0.0
        assert d.finish_ms[p] == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert d.makespan_ms == max(d.finish_ms)


@pytest.mark.parametrize("native", [False, True])
def test_assignment_is_complete_and_respects_capacities(native):
    rng = np.random.default_rng(0)
    for _ in range(40):
        args = random_input(
            rng, int(rng.integers(1, 60)), int(rng.integers(1, 12)), int(rng.integers(1, 5)), ties=bool(rng.integers(2))
        )
        for improve in (False, True):
            check_valid(dispatch(*args, improve=improve, native=native), *args[:3])
    args = benchmark_like(0, 600, (40, 20, 10, 6), (0.0, 1.0, 3.0, 3.0))
    check_valid(dispatch(*args, native=native), *args[:3])


@pytest.mark.parametrize("native", [False, True])
def test_a_sequence_that_fits_nowhere_is_refused_by_length(native):
    times = np.array([[1.0, 2.0, np.inf, 3.0], [1.0, 1.5, 9.0, 2.0]])
    lens = np.array([100, 200, 5000, 300])
    # kind 1 (the only one holding 5000 tokens) has no pipeline here
    with pytest.raises(InfeasibleError, match="5000 tokens fits no pipeline.*longest any pipeline holds here: 300"):
        dispatch(times, [0, 0], [1.0, 1.0], lens, native=native)
    assert sorted(dispatch(times, [0, 1], [1.0, 1.0], lens, native=native).members[1]) == [2]


@pytest.mark.parametrize("native", [False, True])
def test_more_pipelines_than_sequences_leaves_some_empty(native):
    times = np.array([[4.0, 2.0, 1.0], [2.0, 1.0, 0.5]])
    d = dispatch(times, [0, 0, 1, 1, 0, 1, 1], [0.0, 1.0], np.array([30, 20, 10]), native=native)
    check_valid(d, times, np.array([0, 0, 1, 1, 0, 1, 1]), np.array([0.0, 1.0]))
    # each alone; the last one finishes at 1.0 on pipeline 2 (kind 1) as on 4 (kind 0): the lower index
    assert d.members == ((0,), (1,), (2,), (), (), (), ())
    assert d.finish_ms == (4.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0) and d.makespan_ms == 4.0


def scan_greedy(times, kinds, fill, order):
    """The greedy by a scan of every pipeline: the least (finish, index) for each sequence."""
    load, longest, members = [0.0] * len(kinds), [0.0] * len(kinds), [[] for _ in kinds]
    for i in order:
        finish, p = min(
            (load[p] + fill[kinds[p]] * max(longest[p], x) + x, p)
            for p in range(len(kinds))
            if np.isfinite(x := times[kinds[p], i])
        )
        load[p] += times[kinds[p], i]
        longest[p] = max(longest[p], times[kinds[p], i])
        members[p].append(i)
    return tuple(tuple(m) for m in members)


@pytest.mark.parametrize("native", [False, True])
def test_the_heaps_choose_what_a_scan_of_every_pipeline_chooses(native):
    """Integer times, so no rounding: longest first (the heap tops) and in random orders (the
    seed's rule with one trial: the scans when a kind's used pipelines hold shorter ones)."""
    rng = np.random.default_rng(3)
    for _ in range(60):
        times, kinds, fill, lens = random_input(
            rng, int(rng.integers(1, 50)), int(rng.integers(1, 10)), int(rng.integers(1, 4)), ties=True
        )
        want = scan_greedy(times, kinds, fill, np.argsort(-lens, kind="stable"))
        assert dispatch(times, kinds, fill, lens, improve=False, native=native, trials=0).members == want
        seed = int(rng.integers(1000))
        order = np.random.default_rng(seed).permutation(len(lens))
        got = seed_dispatch(times, kinds, fill, lens, trials=1, seed=seed, native=native)
        assert got.members == scan_greedy(times, kinds, fill, order)


@pytest.mark.native  # tests/conftest.py: skipped without the extension, failed under `make test`
@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 80),
    pipelines=st.integers(1, 20),
    kinds=st.integers(1, 6),
    ties=st.booleans(),
    improve=st.booleans(),
)
def test_native_equals_python_exactly(seed, n, pipelines, kinds, ties, improve):
    args = random_input(np.random.default_rng(seed), n, pipelines, kinds, ties=ties)
    assert dispatch(*args, improve=improve, native=True) == dispatch(*args, improve=improve, native=False)
    assert seed_dispatch(*args, trials=3, seed=seed, native=True) == seed_dispatch(*args, trials=3, seed=seed)


@pytest.mark.native
def test_native_equals_python_on_benchmark_like_inputs():
    for seed in range(3):
        args = benchmark_like(seed, 1529, (128, 64, 32, 20), (0.0, 1.0, 3.0, 3.0))
        assert dispatch(*args, native=True) == dispatch(*args, native=False)
        small = benchmark_like(seed, 400, (8, 6, 4, 2), (0.0, 0.25, 0.5, 0.5))
        assert dispatch(*small, native=True) == dispatch(*small, native=False)
    with pytest.raises(ValueError, match="permutation"):
        core.dispatch(np.ones((1, 3)), np.zeros(2, dtype=np.int64), np.ones(1), np.array([0, 0, 1]), 0)


@pytest.mark.parametrize("seed", range(3))
def test_never_worse_than_the_seeds_rule(seed):
    """The seed's best of 50 random orders, on inputs shaped like the benchmark's (the longest
    sequence sets the makespan) and on crowded ones (balance sets it)."""
    for args in (
        benchmark_like(seed, 600, (40, 20, 10, 6), (0.0, 1.0, 3.0, 3.0)),
        benchmark_like(seed, 600, (8, 6, 4, 2), (0.0, 0.25, 0.5, 0.5)),
    ):
        assert dispatch(*args).makespan_ms <= seed_dispatch(*args, seed=seed, native=core is not None).makespan_ms


def test_improvement_never_raises_the_makespan_and_often_lowers_it():
    rng = np.random.default_rng(1)
    lowered = 0
    for _ in range(150):
        args = random_input(
            rng, int(rng.integers(2, 40)), int(rng.integers(2, 8)), int(rng.integers(1, 4)), ties=bool(rng.integers(2))
        )
        greedy, improved = dispatch(*args, improve=False), dispatch(*args)
        assert improved.makespan_ms <= greedy.makespan_ms
        lowered += improved.makespan_ms < greedy.makespan_ms
    assert lowered >= 15


def optimum(times, kinds, fill) -> float:
    best = np.inf
    for assign in itertools.product(range(len(kinds)), repeat=times.shape[1]):
        t = times[kinds[list(assign)], np.arange(times.shape[1])]
        if np.isfinite(t).all():
            best = min(
                best,
                max(
                    t[np.equal(assign, p)].sum() + fill[kinds[p]] * t[np.equal(assign, p)].max(initial=0)
                    for p in range(len(kinds))
                ),
            )
    return best


def test_near_the_optimum_on_tiny_inputs():
    """Greedy + improvement within 1.2x of the brute-force optimum (<= 7 sequences, <= 3
    pipelines) and optimal on at least 95% of such inputs: over 1000 of them, worst 1.163x (a
    local optimum: only a three-way exchange helps), optimal on 98.4% (the greedy alone: worst
    1.54x, optimal on 76.8%)."""
    rng = np.random.default_rng(2)
    ratios = []
    for _ in range(120):
        args = random_input(
            rng, int(rng.integers(1, 8)), int(rng.integers(1, 4)), int(rng.integers(1, 4)), ties=bool(rng.integers(2))
        )
        ratios.append(dispatch(*args).makespan_ms / optimum(*args[:3]))
    ratios = np.array(ratios)
    assert ratios.min() >= 1 - 1e-12
    assert ratios.max() <= 1.2
    assert (ratios <= 1 + 1e-12).mean() >= 0.95


@pytest.mark.parametrize("n", [60, 745])
def test_never_worse_than_the_seed_where_its_orders_are_tried(n):
    """Up to TRIAL_PLACEMENTS / TRIALS sequences, dispatch tries every order the seed tries, and
    longest-first, then improves the best: its makespan is never above the seed's."""
    from dyn_plugin.plan.assignment.dispatch import TRIAL_PLACEMENTS, TRIALS

    assert n * TRIALS <= TRIAL_PLACEMENTS
    for seed in range(4):
        args = benchmark_like(seed, n, (8, 6, 4, 2), (0.0, 1.0, 1.0, 3.0))
        assert dispatch(*args).makespan_ms <= seed_dispatch(*args, native=True).makespan_ms
