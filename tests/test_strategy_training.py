"""Hydraulis's runtime: steps planned under heterogeneous strategies whose pipelines differ only in
sequence-parallel size run for real in DeepSpeed (gloo, CPU).

Four ranks under a hand-made proposal, one group of 2 and two groups of 1, train several steps
through the loader (strategy.enabled, the proposal's JSON file) with ZeRO-1 and ZeRO-3: the
parameters equal the single-process token-mean reference. A run killed after a checkpoint and
resumed, its plans now made by a background planner process, plans every step as the
uninterrupted run did and ends on its very parameters. The unit tests cover the planning context
(every step planned by Hydraulis on the proposal's groupings, the proposal carried to planner
processes as JSON) and the proposals a run refuses at start-up."""

import json

import numpy as np
import pytest

from dyn_plugin.config import ConfigError, DynPluginConfig
from dyn_plugin.cost.from_config import build_cost_model
from dyn_plugin.plan.strategies.schemes import Scheme
from dyn_plugin.plan.strategies.strategy import Proposal, Strategy
from dyn_plugin.runtime.planning import PlanningContext
from ranks import free_port
from test_sequence_parallel_training import EXACT, check_exact, launch

GROUPING = [2, 1, 1]
PROPOSAL = Proposal((Strategy((Scheme(sp=2), Scheme(), Scheme()), longest=256),), key="two-one-one")
STEPS = 3  # of each exact case


def ran_grouping(step) -> list[int]:
    """The group sizes the ranks ran, in column order: each rank's (size, first column) of its shards."""
    groups = {tuple(s[:2]) for record in step["ranks"] for s in record["shards"]}
    return [size for size, _ in sorted(groups, key=lambda g: g[1])]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One launch of four ranks: ZeRO-1 and ZeRO-3 against the reference, STEPS steps each."""
    out = tmp_path_factory.mktemp("strategy")
    PROPOSAL.save(out / "proposal.json")
    plugin = {"strategy": {"enabled": True, "proposal": str(out / "proposal.json")}}
    job = {"plugin": plugin, "exact": [{"zero": z, "count": STEPS} for z in (1, 3)]}
    return out, plugin, launch(out, 4, "full", job)


def check_strategy(case):
    for step in case["steps"]:
        assert ran_grouping(step) == GROUPING, step
        step["grouping"] = GROUPING  # what check_exact holds every rank's shards to
    check_exact(case, 4)  # parameters within EXACT of the reference, every sample once


def test_zero1_and_zero3_equal_the_token_mean_reference(uninterrupted):
    _, _, result = uninterrupted
    assert [c["zero"] for c in result["exact"]] == [1, 3]
    for case in result["exact"]:
        assert [s["index"] for s in case["steps"]] == list(range(STEPS))
        check_strategy(case)
        print(f"ZeRO-{case['zero']}: max |param - reference| = {case['max_abs_diff']:.3g} (bound {EXACT:g})")
        assert case["kinds"] == {"2": "ulysses", "4": "ring"}


def test_a_killed_run_resumes_with_the_same_plans(uninterrupted):
    out, plugin, result = uninterrupted
    full = result["exact"][0]
    launch(
        out, 4, "stop", {"plugin": plugin, "exact": [{"zero": 1, "count": STEPS, "mode": "stop-after:1"}]}, expect=-9
    )  # killed after its checkpoint
    # resumed with a store: the plans now come from a planner process, which got the proposal as JSON
    store = {"store": {"backend": "tcp", "port": free_port(), "namespace": "strategy"}}
    job = {"plugin": {**plugin, **store}, "exact": [{"zero": 1, "count": STEPS, "mode": "resume"}]}
    resumed = launch(out, 4, "resume", job)["exact"][0]
    assert [s["index"] for s in resumed["steps"]] == list(range(1, STEPS))
    assert [s["digest"] for s in resumed["steps"]] == [s["digest"] for s in full["steps"][1:]]
    assert [s["ranks"] for s in resumed["steps"]] == [s["ranks"] for s in full["steps"][1:]]
    check_strategy(resumed)
    assert resumed["weights"] == full["weights"]  # bit for bit the uninterrupted run's parameters


CONFIG = {
    "cost_model": {
        "kind": "analytic",
        "dtype": "fp32",
        "model": {"hidden_size": 64, "num_layers": 4, "num_heads": 4, "ffn_hidden_size": 128, "vocab_size": 100},
    },
    "microbatching": {"global_tokens": 6000, "max_seq_len": 2000},
    # device memory capped so the longest sequences need a group
    "cluster": {"device": {"memory_mb": 48, "memory_fraction": 1.0}},
    "sequence_parallel": {"enabled": True, "sizes": [1, 2, 4]},
    "strategy": {"enabled": True},
}
LENGTHS = np.random.default_rng(0).integers(1, 2000, size=40)


def context(config=CONFIG, **kw) -> PlanningContext:
    cfg = DynPluginConfig.model_validate(config)
    return PlanningContext(cfg, build_cost_model(cfg.cost_model, cfg.cluster), LENGTHS, dp=4, pp=1, **kw)


def test_every_step_is_planned_by_hydraulis_on_the_proposal(tmp_path, caplog):
    with caplog.at_level("INFO", logger="dyn_plugin.runtime.planning"):
        ctx = context()  # proposed at start-up from the lengths
    assert f"strategy proposal {ctx.proposal.key} from the run's 40 lengths: " in caplog.text
    groupings = {s.grouping for s in ctx.proposal.strategies}
    for step, ids in enumerate(ctx.batches(0)):
        plan = ctx.plan_batch([int(LENGTHS[i]) for i in ids])
        assert plan.method == "hydraulis" and plan.group_sizes in groupings, (plan.method, plan.group_sizes)
        assert set(ctx.plan(0, step)) == {(c, 0) for c in range(4)}  # every rank's plan, rendezvous checked
    # whether the proposer mixes sizes depends on the costs; a heterogeneous proposal is planned as it says
    mixed = Proposal((Strategy((Scheme(sp=2), Scheme(), Scheme()), longest=2000),), key="mixed")
    hand = context(proposal=mixed)
    for ids in hand.batches(0):
        assert hand.plan_batch([int(LENGTHS[i]) for i in ids]).group_sizes == (2, 1, 1)
    # a planner process plans from the JSON context alone, with the same proposal and the same plans
    copy = PlanningContext.from_json(ctx.to_json())
    assert copy.proposal == ctx.proposal
    assert [copy.plan(0, s)[(0, 0)].digest for s in range(3)] == [ctx.plan(0, s)[(0, 0)].digest for s in range(3)]
    # the same proposal from a file plans the same
    ctx.proposal.save(tmp_path / "p.json")
    loaded = context({**CONFIG, "strategy": {"enabled": True, "proposal": str(tmp_path / "p.json")}})
    assert loaded.proposal == ctx.proposal
    assert loaded.plan(0, 1)[(2, 0)].digest == ctx.plan(0, 1)[(2, 0)].digest
    assert json.loads(context({**CONFIG, "strategy": {"enabled": False}}).to_json())["proposal"] is None


@pytest.mark.parametrize(
    "pipelines,message",
    [
        (
            (Scheme(tp=2, sp=1),) * 2,
            r"strategy 0 \(2 x tp2pp1sp1.* has pipelines of \(tp, pp\) \[\(2, 1\)\], but this "
            r"run's replicas all have tp=1, pp=1: heterogeneous tensor/pipeline degrees are "
            r"simulation-only \(`dynplugin bench strategy`\)",
        ),
        ((Scheme(sp=2),), r"uses 2 GPUs but the run has 4 data-parallel columns x tp 1 x pp 1 = 4"),
        ((Scheme(sp=4),), r"group size\(s\) \[4\] outside sequence_parallel.sizes = \[1, 2\]"),
    ],
)
def test_a_proposal_the_run_cannot_execute_is_refused_at_start_up(pipelines, message):
    bad = Proposal((Strategy(pipelines, longest=2000),), key="bad")
    config = {**CONFIG, "sequence_parallel": {"enabled": True, "sizes": [1, 2]}}
    with pytest.raises(ConfigError, match=message):
        context(config, proposal=bad)
    with pytest.raises(ConfigError, match="strategy.proposal = '/nonexistent.json' does not exist"):
        context({**CONFIG, "strategy": {"enabled": True, "proposal": "/nonexistent.json"}})
