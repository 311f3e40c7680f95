"""The DynaPipe partition DP: C++ and Python agree, the plan is valid, and optimal on small inputs."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dyn_plugin.config import DeviceSpec, ModelShape
from dyn_plugin.cost import split_layers
from dyn_plugin.cost.analytic import analytic_cost_model
from dyn_plugin.cost.model import features
from dyn_plugin.cost.native import core
from dyn_plugin.cost.sequence_parallel import SequenceParallelCost
from dyn_plugin.cost.table import evaluate_stage
from dyn_plugin.plan.steps import microbatch
from dyn_plugin.plan.steps.microbatch import InfeasibleError, StageMemory, partition

SHAPE = ModelShape(
    hidden_size=1024, num_layers=8, num_heads=16, ffn_hidden_size=4096, vocab_size=32000, flash_attention=False
)
COST = analytic_cost_model(SHAPE, DeviceSpec(memory_mb=16000, peak_tflops=100, layer_overhead_ms=0.5))
RECOMPUTES = ("none", "selective", "full")


def memory_for(pp: int, budget_gb: float):
    return [StageMemory(budget_gb * 2**30, pp - s) for s in range(pp)]


def run_fits(lens, layout, rc, stages, memory):
    table = COST.table(layout, rc)
    f = features(lens, layout)
    for spec, mem in zip(stages, memory):
        c = evaluate_stage(table, f, spec)
        if mem.in_flight * c.stored_bytes + c.peak_bytes - c.stored_bytes > mem.budget:
            return None
    return max(evaluate_stage(table, f, s).forward_ms + evaluate_stage(table, f, s).backward_ms for s in stages)


def check_valid(p, lens, stages, memory, dp):
    assert sorted(p.order) == list(range(len(lens)))  # every sample exactly once
    assert p.bounds[0] == 0 and p.bounds[-1] == len(lens) and list(p.bounds) == sorted(p.bounds)
    assert (len(p.bounds) - 1) % dp == 0
    assert [lens[i] for i in p.order] == sorted(lens, reverse=True)
    for (a, b), rc in zip(zip(p.bounds, p.bounds[1:]), p.recompute):
        assert b > a
        assert run_fits([lens[i] for i in p.order[a:b]], p.layout, rc, stages, memory) is not None


inputs = dict(
    lens=st.lists(st.integers(1, 6000), min_size=1, max_size=14),
    layout=st.sampled_from(["padded", "packed"]),
    pp=st.integers(1, 3),
    dp=st.integers(1, 3),
    budget=st.floats(4, 40),
)


@pytest.mark.native  # tests/conftest.py: skipped without the extension, failed under `make test`
@settings(max_examples=120, deadline=None)
@given(**inputs)
def test_native_and_python_give_the_same_plan(lens, layout, pp, dp, budget):
    stages, memory = split_layers(8, pp), memory_for(pp, budget)
    kw = dict(layout=layout, stages=stages, memory=memory, dp=dp)
    try:
        py = partition(lens, COST, native=False, **kw)
    except ValueError as exc:
        with pytest.raises(type(exc)):
            partition(lens, COST, native=True, **kw)
        return
    nat = partition(lens, COST, native=True, **kw)
    assert nat == py
    check_valid(py, lens, stages, memory, dp)


def brute_force(lens, layout, stages, memory, dp):
    order = sorted(lens, reverse=True)
    n, pp, best = len(order), len(stages), np.inf
    for cuts in itertools.product([0, 1], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        if (len(bounds) - 1) % dp:
            continue
        times = []
        for a, b in zip(bounds, bounds[1:]):
            ts = [t for rc in RECOMPUTES if (t := run_fits(order[a:b], layout, rc, stages, memory)) is not None]
            if not ts:
                break
            times.append(min(ts))
        else:
            best = min(best, (pp - 1) * max(times) + sum(times) / dp)
    return best


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 6000), min_size=1, max_size=7),
    layout=st.sampled_from(["padded", "packed"]),
    pp=st.integers(1, 3),
    dp=st.integers(1, 2),
    budget=st.floats(4, 40),
)
def test_dp_matches_brute_force_on_small_inputs(lens, layout, pp, dp, budget):
    stages, memory = split_layers(8, pp), memory_for(pp, budget)
    want = brute_force(lens, layout, stages, memory, dp)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(microbatch, "THIN", 0.0)  # no thinning of t_max candidates: the DP is exact
        for native in (False, True) if core is not None else (False,):
            if want == np.inf:
                with pytest.raises(ValueError):
                    partition(lens, COST, layout=layout, stages=stages, memory=memory, dp=dp, native=native)
                continue
            got = partition(lens, COST, layout=layout, stages=stages, memory=memory, dp=dp, native=native)
            assert got.objective == pytest.approx(want, rel=1e-9)


def test_recompute_only_where_memory_demands_it():
    stages, memory = split_layers(8, 2), memory_for(2, 6)
    lens = [4000, 3000, 200, 100, 50]
    p = partition(lens, COST, layout="packed", stages=stages, memory=memory)
    assert p.recompute[0] != "none"  # the longest does not fit without recompute
    for (a, b), rc in zip(zip(p.bounds, p.bounds[1:]), p.recompute):
        run = [lens[i] for i in p.order[a:b]]
        feasible = {m: t for m in RECOMPUTES if (t := run_fits(run, "packed", m, stages, memory)) is not None}
        assert feasible[rc] == min(feasible.values())  # the cheapest mode that fits, per micro-batch
    roomy = partition([4000, 3000, 200, 100, 50], COST, layout="packed", stages=stages, memory=memory_for(2, 400))
    assert set(roomy.recompute) == {"none"}


def test_infeasible_sequence_is_named():
    stages, memory = split_layers(8, 2), memory_for(2, 1)
    with pytest.raises(InfeasibleError, match=r"sequence 1 \(length 60000\) does not fit"):
        partition([100, 60000, 200], COST, layout="packed", stages=stages, memory=memory)


def test_fewer_sequences_than_replicas_is_refused():
    with pytest.raises(ValueError, match="cannot give each of 4 data-parallel ranks"):
        partition([10, 20], COST, layout="packed", stages=split_layers(8, 1), memory=memory_for(1, 10), dp=4)


# Sequence parallelism: runs split over sp ranks, priced per rank plus each layer's collectives.
SP_LINK = dict(hidden=1024, kv_hidden=1024, heads=16, act_bytes=2, link_gb_per_s=25.0, latency_us=10.0)


def layer_comms(sp, kind="ulysses", cost=SequenceParallelCost()):
    return [cost.layer(sp, kind, rc, **SP_LINK) for rc in RECOMPUTES]


@pytest.mark.native
@settings(max_examples=120, deadline=None)
@given(**inputs, sp=st.sampled_from([1, 2, 4]), kind=st.sampled_from(["ulysses", "ring"]), priced=st.booleans())
def test_native_and_python_give_the_same_plan_split_over_sp_ranks(lens, layout, pp, dp, budget, sp, kind, priced):
    stages, memory = split_layers(8, pp), memory_for(pp, budget)
    kw = dict(layout=layout, stages=stages, memory=memory, dp=dp, sp=sp, comm=layer_comms(sp, kind) if priced else None)
    try:
        py = partition(lens, COST, native=False, **kw)
    except ValueError as exc:
        with pytest.raises(type(exc)):
            partition(lens, COST, native=True, **kw)
        return
    assert partition(lens, COST, native=True, **kw) == py


@pytest.mark.native
@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 6000), min_size=1, max_size=9),
    layout=st.sampled_from(["padded", "packed"]),
    sp=st.sampled_from([1, 2, 4, 8]),
    rc=st.sampled_from(RECOMPUTES),
)
def test_native_features_per_rank_match_python(lens, layout, sp, rc):
    """A micro-batch's per-rank cost in C++ (the row rounded up to sp, a padding document for
    packed rows) is exactly the Python twin's on ``features(..., sp)``."""
    stage = split_layers(8, 2)[1]
    want = evaluate_stage(COST.table(layout, rc), features(lens, layout, COST.pad_multiple, sp), stage)
    got = COST.native(layout, rc).stage_cost(lens, stage.num_layers, stage.first, stage.last, sp)
    assert got[:4] == (want.forward_ms, want.backward_ms, want.stored_bytes, want.peak_bytes)


def planner_spec(pp, budget_gb, attention):
    from dyn_plugin.plan.steps.spec import PlannerSpec
    from dyn_plugin.plan.steps.types import LinkSpec

    return PlannerSpec(
        cost=COST,
        stages=tuple(split_layers(8, pp)),
        memory=tuple(memory_for(pp, budget_gb)),
        dp=4,
        link=LinkSpec(25.0),
        hidden_size=SHAPE.hidden_size,
        sp_sizes=(1, 2, 4),
        sp_attention=attention,
        sp_link=(LinkSpec(25.0), LinkSpec(12.5)),
        devices_per_node=8,
    )


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 6000), min_size=1, max_size=8),
    layout=st.sampled_from(["padded", "packed"]),
    pp=st.integers(1, 3),
    sp=st.sampled_from([2, 4]),
    attention=st.sampled_from(["ulysses", "ring"]),
)
def test_runs_cost_what_the_planner_prices_their_micro_batch(lens, layout, pp, sp, attention):
    """Every run the DP considers costs exactly what ``make_micro_batch`` charges the micro-batch it
    becomes, collectives included, in the mode the DP picked for it."""
    from dyn_plugin.plan.steps.pricing import make_micro_batch

    spec = planner_spec(pp, 20, attention)
    order = sorted(lens, reverse=True)
    comm = [spec.layer_comm(sp, rc) for rc in RECOMPUTES]
    times, modes = microbatch.run_costs(
        np.array(order), COST, layout, RECOMPUTES, spec.stages, spec.memory, sp=sp, comm=comm
    )
    for i, (ts, ms) in enumerate(zip(times, modes)):
        for w, (t, m) in enumerate(zip(ts, ms)):
            mb = make_micro_batch(range(i, i + w + 1), order, spec=spec, layout=layout, recompute=RECOMPUTES[m], sp=sp)
            assert mb.time_ms == t


def test_a_sequence_too_long_for_one_rank_fits_split_over_four():
    stages, memory = split_layers(8, 2), memory_for(2, 4)
    with pytest.raises(InfeasibleError, match="length 12000"):
        partition([12000, 100], COST, layout="packed", stages=stages, memory=memory)
    for native in (False, True) if core is not None else (False,):
        p = partition(
            [12000, 100], COST, layout="packed", stages=stages, memory=memory, sp=4, comm=layer_comms(4), native=native
        )
        assert p.bounds[-1] == 2 and p.recompute[0] != "none"
    with pytest.raises(ValueError, match="power of two, got sp=3"):
        partition([100], COST, layout="packed", stages=stages, memory=memory, sp=3)
    with pytest.raises(ValueError, match="one LayerComm per recompute mode"):
        partition([100], COST, layout="packed", stages=stages, memory=memory, sp=2, comm=layer_comms(2)[:1])
