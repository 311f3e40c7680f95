"""DynaPipe over (input, target) pairs: the DP against brute force, memory respected, encoder then
decoder stages simulated with their own links, the baselines (plan/pair_*.py)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dyn_plugin.config import DynPluginConfig
from dyn_plugin.cost.bundled import MEASURED_DIR
from dyn_plugin.cost.encoder_decoder import PairStage, import_t5_tables
from dyn_plugin.plan.methods.pair_baselines import PAIR_BASELINES, budget_pair_groups
from dyn_plugin.plan.steps import microbatch
from dyn_plugin.plan.steps.microbatch import InfeasibleError, StageMemory
from dyn_plugin.plan.steps.pair_microbatch import (
    ORDERS,
    make_pair_micro_batch,
    order_pairs,
    partition_pairs,
)
from dyn_plugin.plan.steps.pair_planner import plan_pairs
from dyn_plugin.plan.steps.pair_spec import PairSpec, balanced_split_rank, pair_planner_spec, split_stages
from dyn_plugin.plan.steps.pricing import usable
from dyn_plugin.plan.steps.schedule import one_f_one_b
from dyn_plugin.plan.steps.simulator import simulate, stage_peak_bytes
from dyn_plugin.plan.steps.types import LinkSpec

COST = import_t5_tables(MEASURED_DIR / "a100-t5-11b.json")
GIB = 2**30


def spec_for(pp: int, split: int, dp: int, budget_gib: float, tp: int = 4) -> PairSpec:
    stages = split_stages(COST, pp, split)
    memory = tuple(StageMemory(budget_gib * GIB, pp - s) for s in range(pp))
    return PairSpec(cost=COST, stages=stages, memory=memory, dp=dp, link=LinkSpec(100.0), tp=tp)


def synthetic_pairs(n: int, seed: int) -> tuple[list[int], list[int]]:
    """Three tasks: long input / short target, short input / long target, both middling."""
    rng = np.random.default_rng(seed)
    task = rng.integers(3, size=n)
    mu_in, mu_out = np.array([6.0, 4.5, 5.5])[task], np.array([3.5, 5.5, 4.5])[task]
    ins = np.clip(rng.lognormal(mu_in, 0.8), 4, 4096).astype(int)
    outs = np.clip(rng.lognormal(mu_out, 0.8), 2, 2048).astype(int)
    return ins.tolist(), outs.tolist()


def run_time(ids, ins, outs, spec):
    """The run's time in its cheapest recompute mode that fits, as the DP prices it; None if none."""
    times = [
        mb.time_ms
        for rc in spec.recomputes
        if usable(mb := make_pair_micro_batch(ids, ins, outs, spec=spec, recompute=rc), spec)
    ]
    return min(times, default=None)


def brute_force(ins, outs, spec):
    best = np.inf
    for by in ORDERS:
        order = order_pairs(ins, outs, by).tolist()
        n = len(order)
        for cuts in itertools.product([0, 1], repeat=n - 1):
            bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
            if (len(bounds) - 1) % spec.dp:
                continue
            times = [run_time(order[a:b], ins, outs, spec) for a, b in zip(bounds, bounds[1:])]
            if None not in times:
                best = min(best, (spec.pp - 1) * max(times) + sum(times) / spec.dp)
    return best


@settings(max_examples=40, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(1, 4096), st.integers(1, 4096)), min_size=1, max_size=6),
    pp=st.integers(2, 3),
    dp=st.integers(1, 2),
    budget=st.floats(0.3, 20),
)
def test_dp_matches_brute_force_on_small_inputs(pairs, pp, dp, budget):
    ins, outs = [a for a, _ in pairs], [b for _, b in pairs]
    spec = spec_for(pp, 1, dp, budget)
    want = brute_force(ins, outs, spec) if len(pairs) >= dp else np.inf
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(microbatch, "THIN", 0.0)  # every run time a t_max candidate: the DP is exact
        if want == np.inf:
            with pytest.raises(ValueError):
                partition_pairs(ins, outs, spec)
            return
        got = partition_pairs(ins, outs, spec)
    assert got.objective == pytest.approx(want, rel=1e-9)
    # a valid partition: every pair once, a multiple of dp micro-batches, each run fits in its mode
    assert sorted(got.order) == list(range(len(pairs)))
    assert (len(got.bounds) - 1) % dp == 0
    for ids, rc in zip(got.groups(), got.recompute):
        assert usable(make_pair_micro_batch(ids, ins, outs, spec=spec, recompute=rc), spec)


def test_plan_respects_memory_and_covers_every_pair_once():
    ins, outs = synthetic_pairs(120, 1)
    spec = spec_for(4, 2, 2, 6.0)
    plan = plan_pairs(ins, outs, spec)
    assert sorted(i for mb in plan.micro_batches for i in mb.sample_ids) == list(range(len(ins)))
    assert len({len(r.micro_batches) for r in plan.replicas}) == 1  # the same count on every replica
    modes = {mb.recompute for mb in plan.micro_batches}
    assert len(modes) > 1, "a 6 GiB budget should make long micro-batches recompute and short ones not"
    for rep in plan.replicas:
        # in range, and the schedule's true peak per stage within the budget (recompute was relaxed
        # where the schedule leaves memory spare, so a micro-batch alone need not fit with as many in
        # flight as 1F1B could hold)
        assert not any(mb.extrapolated for mb in rep.micro_batches)
        assert all(p <= m.budget for p, m in zip(rep.sim.peak_bytes, spec.memory))
        assert rep.sim.peak_bytes == tuple(
            stage_peak_bytes(rep.micro_batches, ops, s) for s, ops in enumerate(rep.schedule.stages)
        )


def test_infeasible_pair_is_named():
    spec = spec_for(2, 1, 1, 0.05)
    with pytest.raises(InfeasibleError, match=r"pair 1 \(input 4000, target 3000\)"):
        partition_pairs([10, 4000], [10, 3000], spec)
    with pytest.raises(ValueError, match="data-parallel"):
        partition_pairs([10], [10], spec_for(2, 1, 2, 10))


def test_encoder_stages_then_decoder_stages():
    stages = split_stages(COST, 4, 1)
    assert [(s.encoder_layers, s.decoder_layers, s.embedding, s.last) for s in stages] == [
        (24, 0, True, False),
        (0, 8, True, False),
        (0, 8, False, False),
        (0, 8, False, True),
    ]
    assert split_stages(COST, 1, 0) == (PairStage(24, 24, embedding=True, last=True),)
    with pytest.raises(ValueError, match="split rank"):
        split_stages(COST, 4, 4)
    # decoder layers cost more than encoder layers: at pp=4 an even 2 + 2 split beats 3 + 1
    assert balanced_split_rank(COST, 4, reference=(8, 512, 128), tp=4) == 2
    # long targets move the balance towards more decoder stages
    assert balanced_split_rank(COST, 4, reference=(2, 64, 2048), tp=4) == 1


def test_links_carry_the_encoder_output():
    spec = spec_for(4, 2, 1, 20)
    mb = make_pair_micro_batch([0, 1], [512, 300], [64, 40], spec=spec, recompute="none")
    h, b = COST.hidden_size, COST.act_bytes
    enc_out = 2 * 512 * h * b / spec.tp
    assert mb.link_bytes == pytest.approx((enc_out, enc_out, enc_out + 2 * 64 * h * b / spec.tp))
    assert mb.token_slots == 2 * 512 + 2 * 64 and mb.real_tokens == 512 + 300 + 64 + 40
    # one micro-batch through the pipeline: every forward, every backward and each link twice
    slow = LinkSpec(0.01, latency_us=0.0)  # slow enough that the links show
    sim = simulate([mb], one_f_one_b(1, 4), slow)
    hops = 2 * sum(slow.transfer_ms(x) for x in mb.link_bytes)
    assert sim.makespan_ms == pytest.approx(sum(mb.forward_ms) + sum(mb.backward_ms) + hops)


def test_spec_from_config():
    cfg = DynPluginConfig.model_validate(
        {
            "pipeline": {"stages": 4},
            "cluster": {"devices_per_node": 8, "device": {"memory_mb": 72000, "memory_fraction": 1.0}},
        }
    )
    spec = pair_planner_spec(COST, cfg, dp=2, zero_stage=1)
    assert spec.pp == 4 and spec.split_rank == 2 and [m.in_flight for m in spec.memory] == [4, 3, 2, 1]
    # the decoder stages hold more parameters: less memory left for activations
    assert spec.memory[3].budget < spec.memory[0].budget
    # data parallel only: one stage holds both sides (ZeRO-3 over 8 ranks leaves room)
    one = DynPluginConfig.model_validate(
        {"pipeline": {"stages": 1}, "cluster": {"device": {"memory_mb": 72000, "memory_fraction": 1.0}}}
    )
    flat = pair_planner_spec(COST, one, dp=8, zero_stage=3)
    assert flat.split_rank == 0 and flat.memory[0].in_flight == 1
    ins, outs = synthetic_pairs(40, 3)
    plan = plan_pairs(ins, outs, flat)
    assert len(plan.replicas) == 8 and sorted(i for mb in plan.micro_batches for i in mb.sample_ids) == list(range(40))
    # ZeRO-3: the i-th micro-batch of every replica's run order recomputes alike
    for pos in range(len(plan.replicas[0].micro_batches)):
        assert len({r.micro_batches[r.schedule.order[pos]].recompute for r in plan.replicas}) == 1
    small = DynPluginConfig.model_validate({"pipeline": {"stages": 2}, "cluster": {"device": {"memory_mb": 40000}}})
    with pytest.raises(ValueError, match="model states"):
        pair_planner_spec(COST, small, dp=1)


def test_spec_takes_a_sharding_plans_model_states():
    """As planner_spec for GPT: the plan's states in place of ZeRO's, out of the sharding budget,
    with ZeRO-3's rules whatever the ZeRO stage."""
    cfg = DynPluginConfig.model_validate(
        {"cluster": {"device": {"memory_mb": 400000, "memory_fraction": 1.0}}, "sharding": {"memory_budget_mb": 9000}}
    )
    spec = pair_planner_spec(COST, cfg, dp=2, zero_stage=0, state_bytes=1000 * 2**20)
    assert spec.memory[0].budget == 8000 * 2**20 and spec.memory[0].states == 1000 * 2**20
    assert spec.same_recompute
    ins, outs = synthetic_pairs(40, 3)
    plan = plan_pairs(ins, outs, spec)
    assert all(p <= spec.memory[0].budget for r in plan.replicas for p in r.sim.peak_bytes)
    for pos in range(len(plan.replicas[0].micro_batches)):
        assert len({r.micro_batches[r.schedule.order[pos]].recompute for r in plan.replicas}) == 1
    with pytest.raises(ValueError, match="none is left for activations"):
        pair_planner_spec(COST, cfg, dp=2, state_bytes=9000 * 2**20)
    two = DynPluginConfig.model_validate({"pipeline": {"stages": 2}, "cluster": {"device": {"memory_mb": 400000}}})
    with pytest.raises(ValueError, match="need pipeline.stages = 1, not 2"):
        pair_planner_spec(COST, two, dp=1, state_bytes=1.0)


def test_baselines_cover_every_pair_and_are_slower_here():
    ins, outs = synthetic_pairs(150, 2)
    spec = spec_for(4, 2, 2, 8.0)
    plugin = plan_pairs(ins, outs, spec)
    for name, fn in PAIR_BASELINES.items():
        plan = fn(ins, outs, spec, max(ins), max(outs))
        assert plan.method == name
        assert sorted(i for mb in plan.micro_batches for i in mb.sample_ids) == list(range(len(ins)))
        assert all(usable(mb, spec) for mb in plan.micro_batches)
        assert len({mb.recompute for mb in plan.micro_batches}) == 1  # one mode for the step, as configured
        assert plan.iteration_ms > plugin.iteration_ms, name


def test_budget_groups():
    assert budget_pair_groups([5, 5, 5], [5, 5, 5], 20) == [[0, 1], [2]]
    assert budget_pair_groups([5, 5, 5], [5, 5, 5], 100, max_pairs=2) == [[0, 1], [2]]


def test_bench_planner_t5_prints_json(capsys):
    from dyn_plugin.cli import main

    argv = ["bench", "planner", "--model", "t5-11b", "--global-tokens", "16384", "--parallel", "4x2", "--batches", "1"]
    assert main(argv + ["--json"]) == 0
    every = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # 24 decoder layers on one stage (split 3) leave no memory for activations: said, not skipped
    assert [(r["split_rank"], r["method"]) for r in every if "error" in r] == [(3, "all")]
    records = [r for r in every if r["split_rank"] == 1]
    assert {r["method"] for r in records} == {"dynapipe", "dynapipe_zero_bubble", *PAIR_BASELINES}
    assert all(r["model"] == "t5-11b" and r["distribution"] == "tasks" and "error" not in r for r in records)
    plan = next(r for r in records if r["method"] == "dynapipe")
    assert plan["plan_ms_p50"] > 0 and plan["sim_iter_ms"] > 0 and plan["pairs"] > 1
    for r in records:
        if r["method"] == "dynapipe_zero_bubble":  # splits kept only where the step gets shorter
            assert r["speedup_vs_dynapipe"] == pytest.approx(plan["sim_iter_ms"] / r["sim_iter_ms"])
            assert r["speedup_vs_dynapipe"] >= 1.0 and set(r["schedules"]) <= {"zero_bubble", "1f1b", "adaptive"}
        elif r["method"] != "dynapipe":
            assert r["slowdown_vs_dynapipe"] == pytest.approx(r["sim_iter_ms"] / plan["sim_iter_ms"])
