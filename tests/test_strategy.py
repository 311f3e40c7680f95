"""Hydraulis's strategies: the proposal, its JSON and cache, and two-stage steps under it."""

import json
import subprocess
import sys

import numpy as np
import pytest

from dyn_plugin.bench.strategy import strategy_config
from dyn_plugin.config import DynPluginConfig
from dyn_plugin.cost.calibrated import named_cost_model
from dyn_plugin.lengths.io import load_lengths
from dyn_plugin.plan.methods.planner import execution_plans
from dyn_plugin.plan.steps.microbatch import InfeasibleError
from dyn_plugin.plan.steps.spec import planner_spec
from dyn_plugin.plan.strategies.schemes import Scheme, scheme_costs
from dyn_plugin.plan.strategies.strategy import (
    Proposal,
    Strategy,
    cached_proposal,
    neighbours,
    plan_cluster_step,
    plan_strategy_step,
    proposal_key,
    propose,
    runnable_proposal,
)
from dyn_plugin.runtime.planning import step_digest
from dyn_plugin.runtime.sampler import global_batches

GPUS, MAX_LEN, TOKENS = 16, 16384, 16 * 4096


@pytest.fixture(scope="module")
def setting():
    kinds = scheme_costs(named_cost_model("gpt-6.7b"), strategy_config(MAX_LEN), gpus=GPUS)
    lengths = np.minimum(load_lengths("mixture"), MAX_LEN)
    proposal = propose(lengths, kinds, gpus=GPUS, tokens=TOKENS, refine=4, batches=1)
    batches = [np.asarray([int(lengths[i]) for i in b]) for b in global_batches(lengths, TOKENS, 3, 0)]
    return kinds, {k.scheme: k for k in kinds}, lengths, proposal, batches


def test_proposal_uses_every_gpu_and_holds_the_longest(setting):
    kinds, by_scheme, lengths, proposal, _ = setting
    assert proposal.strategies
    for s in proposal.strategies:
        assert s.gpus <= GPUS and GPUS - s.gpus < min(p.gpus for p in s.pipelines), s.describe()
        assert s.longest == max(by_scheme[p].longest for p in s.pipelines)
        assert list(s.pipelines) == sorted(s.pipelines, key=lambda p: -p.gpus) or len(set(s.pipelines)) > 1
    assert max(s.longest for s in proposal.strategies) >= int(lengths.max())
    homo = [s for s in proposal.strategies if len(set(s.pipelines)) == 1]
    assert homo, "the best homogeneous strategy is always a candidate"


def test_proposal_is_deterministic_and_keyed_by_its_inputs(setting):
    kinds, _, lengths, proposal, _ = setting
    again = propose(lengths, kinds, gpus=GPUS, tokens=TOKENS, refine=4, batches=1)
    assert again.to_json() == proposal.to_json()
    assert proposal.key == proposal_key(lengths, kinds, gpus=GPUS, tokens=TOKENS, max_strategies=3, refine=4, batches=1)
    assert proposal.key != proposal_key(
        lengths, kinds, gpus=GPUS, tokens=2 * TOKENS, max_strategies=3, refine=4, batches=1
    )
    assert proposal.key != proposal_key(
        lengths[:-1], kinds, gpus=GPUS, tokens=TOKENS, max_strategies=3, refine=4, batches=1
    )


def test_proposal_json_round_trip_and_cache(setting, tmp_path):
    proposal = setting[3]
    back = Proposal.from_json(proposal.to_json())
    assert back == proposal and back.inputs == proposal.inputs
    made = []

    def make():
        made.append(1)
        return proposal

    first = cached_proposal(proposal.key, tmp_path, make)
    second = cached_proposal(proposal.key, tmp_path, make)
    assert first == second == proposal and made == [1]  # the second came from the JSON file
    assert json.loads((tmp_path / f"strategy-{proposal.key}.json").read_text())["key"] == proposal.key
    with pytest.raises(ValueError, match="not a strategy proposal"):
        Proposal.from_json(json.dumps({"schema": "something else"}))


def test_too_long_a_sequence_is_refused_by_name(setting):
    kinds = setting[0]
    with pytest.raises(ValueError, match=r"longest sequence \(99999 tokens\) fits no scheme"):
        propose([100, 99999], kinds, gpus=GPUS, tokens=TOKENS)


def test_every_sequence_once_within_each_pipelines_memory(setting):
    _, by_scheme, _, proposal, batches = setting
    for lens in batches:
        plan, strategy = plan_cluster_step(lens, proposal.strategies, by_scheme)
        assert strategy in proposal.strategies and strategy.longest >= lens.max()
        ids = sorted(i for mb in plan.micro_batches for i in mb.sample_ids)
        assert ids == list(range(len(lens)))
        for rep in plan.replicas:
            spec = by_scheme[Scheme(rep.tp, len(rep.schedule.stages), rep.size)].spec
            assert max(rep.sim.peak_bytes) <= max(m.budget for m in spec.memory) * (1 + 1e-9)
            assert all(mb.sp == rep.size for mb in rep.micro_batches)


def test_idle_pipelines_sit_out_and_mixed_degrees_do_not_run(setting):
    _, by_scheme, _, _, _ = setting
    wide, narrow = Scheme(4, 1, 2), Scheme(1, 2, 1)
    strategy = Strategy((wide,) + (narrow,) * 4, by_scheme[wide].longest)
    plan, _ = plan_cluster_step(np.array([9000, 300, 200]), [strategy], by_scheme)
    assert len(plan.replicas) == 3  # two narrow pipelines got nothing and sit the step out
    assert sorted(i for mb in plan.micro_batches for i in mb.sample_ids) == [0, 1, 2]
    with pytest.raises(ValueError, match="simulated only"):
        execution_plans(plan, 4096)
    with pytest.raises(InfeasibleError, match="no strategy runs this batch"):
        plan_cluster_step(np.array([MAX_LEN]), [Strategy((narrow,) * 8, by_scheme[narrow].longest)], by_scheme)


def test_neighbours_keep_the_gpus(setting):
    strategy = setting[3].strategies[0]
    pool = sorted({Scheme(4, 1, k) for k in (1, 2, 4)} | set(strategy.pipelines), key=lambda s: s.gpus)
    for n in neighbours(strategy, pool):
        assert sum(p.gpus for p in n) == strategy.gpus and n != strategy.pipelines


DIGEST = """
import sys, numpy as np
from dyn_plugin.bench.strategy import strategy_config
from dyn_plugin.cost.calibrated import named_cost_model
from dyn_plugin.plan.strategies.schemes import scheme_costs
from dyn_plugin.plan.strategies.strategy import Proposal, plan_cluster_step, Stage2Options
from dyn_plugin.runtime.planning import step_digest
kinds = {k.scheme: k for k in scheme_costs(named_cost_model("gpt-6.7b"), strategy_config(16384), gpus=16)}
proposal = Proposal.from_json(open(sys.argv[1]).read())
lens = np.array([int(x) for x in sys.argv[2].split(",")])
for stage2 in ("dp", "ilp"):
    plan, _ = plan_cluster_step(lens, proposal.strategies, kinds, stage2=Stage2Options(stage2, node_limit=200))
    print(step_digest(plan))
"""


def test_plan_digests_equal_across_processes(setting, tmp_path):
    _, by_scheme, _, proposal, batches = setting
    path = tmp_path / "proposal.json"
    proposal.save(path)
    lens = ",".join(str(x) for x in batches[0][:120])
    outs = [
        subprocess.run(
            [sys.executable, "-c", DIGEST, str(path), lens], capture_output=True, text=True, check=True
        ).stdout.split()
        for _ in range(2)
    ]
    assert outs[0] == outs[1] and len(outs[0]) == 2
    plan, _ = plan_cluster_step(batches[0][:120], proposal.strategies, by_scheme)
    assert outs[0][0] == step_digest(plan)


def tiny_spec(zero_stage: int):
    cfg = DynPluginConfig.model_validate(
        {
            "cost_model": {
                "kind": "analytic",
                "model": {
                    "hidden_size": 64,
                    "num_layers": 2,
                    "num_heads": 4,
                    "ffn_hidden_size": 128,
                    "vocab_size": 256,
                },
            },
            "microbatching": {"max_seq_len": 512, "layout": "packed"},
            "sequence_parallel": {"enabled": True, "sizes": [1, 2]},
            "cluster": {"devices_per_node": 4, "device": {"memory_mb": 60, "memory_fraction": 1.0}},
        }
    )
    from dyn_plugin.cost.from_config import build_cost_model

    return planner_spec(build_cost_model(cfg.cost_model, cfg.cluster), cfg, dp=4, zero_stage=zero_stage)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_runnable_proposal_plans_real_steps(zero_stage):
    spec = tiny_spec(zero_stage)
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(8, 64, 400), [500, 480, 300]])
    proposal = runnable_proposal(lengths, spec, tokens=2048)
    assert all(s.runnable(spec.tp, spec.pp) and sum(s.grouping) == 4 for s in proposal.strategies)
    for _ in range(3):
        lens = np.concatenate([rng.integers(8, 64, 30), [int(rng.choice([500, 300, 60]))]])
        plan = plan_strategy_step(lens, spec, proposal)
        assert plan.method == "hydraulis" and sum(plan.group_sizes) == 4
        assert tuple(plan.group_sizes) in {s.grouping for s in proposal.strategies}
        assert sorted(i for mb in plan.micro_batches for i in mb.sample_ids) == list(range(len(lens)))
        if zero_stage == 3:
            assert len({len(r.micro_batches) for r in plan.replicas}) == 1
        execution_plans(plan, 64)  # runs: one tp and pp, aligned groups
    bad = Proposal((Strategy((Scheme(2, 1, 1),) * 2, 512),), "k")
    with pytest.raises(ValueError, match="simulated only"):
        plan_strategy_step(lengths[:10], spec, bad)


def test_rebalancing_never_slows_a_step(setting):
    _, by_scheme, _, proposal, batches = setting
    for lens in batches:
        plain, _ = plan_cluster_step(lens, proposal.strategies, by_scheme, rebalance=False)
        again, _ = plan_cluster_step(lens, proposal.strategies, by_scheme, rebalance=True)
        assert again.iteration_ms <= plain.iteration_ms
        assert sorted(i for mb in again.micro_batches for i in mb.sample_ids) == list(range(len(lens)))


def test_memory_record_prices_plans_by_the_model_and_by_the_measured_tables(setting):
    """A strategy step's peak per GPU: activations (simulated in-flight peak) plus the model states
    its spec charges; by the cost model the plan fits the memory it was planned for, and the
    measured tables price the same schedules independently (issue 24)."""
    from dataclasses import replace

    from dyn_plugin.bench.memory import MB, measured_tables, memory_record, table_micro_batch

    kinds, by_scheme, _, proposal, batches = setting
    specs = {(k.scheme.tp, k.scheme.pp, k.scheme.sp): k.spec for k in kinds}
    device = 36000 * MB
    tables = measured_tables("gpt-6.7b")
    plans = [plan_cluster_step(b, proposal.strategies, by_scheme)[0] for b in batches[:2]]
    rec = memory_record(plans, specs, device, tables=tables)
    assert rec["fits"] and rec["memory_limit_mb"] == 36000 and 0 < rec["peak_mem_mb"] <= 36000 * (1 + 1e-9)
    states = min(m.states for k in kinds for m in k.spec.memory)
    assert rec["peak_mem_mb"] * MB > states and rec["peak_mem_mb_tables"] * MB > states
    # by its own estimate a plan stays within what plans may fill (the device less the allocator's margin)
    plannable = max(m.states + m.budget for k in kinds for m in k.spec.memory)
    assert plannable < device and rec["peak_mem_mb"] * MB <= plannable * (1 + 1e-9)
    assert rec["fits_tables"] == (rec["peak_mem_mb_tables"] <= 36000 * (1 + 1e-9))
    # a limit just under the peak is exceeded; the states stay those the specs were built with
    tight = memory_record(plans, specs, rec["peak_mem_mb"] * MB * 0.999, tables=tables)
    assert not tight["fits"] and tight["peak_mem_mb"] == rec["peak_mem_mb"]
    # the tables' pricing of one micro-batch: per stage, stored <= peak, and a longer sequence holds more
    rep = plans[0].replicas[0]
    spec = specs[(rep.tp, len(rep.schedule.stages), rep.size)]
    mb = rep.micro_batches[0]
    priced, beyond = table_micro_batch(mb, spec, tables)
    assert beyond in (0, 1) and all(0 < s <= p for s, p in zip(priced.stored_bytes, priced.peak_bytes))
    longer = replace(mb, seq_lens=tuple(s * 2 for s in mb.seq_lens))
    assert sum(table_micro_batch(longer, spec, tables)[0].stored_bytes) > sum(priced.stored_bytes)
