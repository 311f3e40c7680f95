"""The planner end to end on the measured A100 costs, against the baselines."""

import json
from dataclasses import replace

import numpy as np
import pytest

from dyn_plugin.cli import main
from dyn_plugin.config import DynPluginConfig, load_config
from dyn_plugin.cost.from_config import build_cost_model
from dyn_plugin.lengths.io import load_lengths
from dyn_plugin.lengths.packing import pack_rows
from dyn_plugin.plan.methods.baselines import BASELINES, plan_baseline
from dyn_plugin.plan.methods.planner import execution_plans, plan_step
from dyn_plugin.plan.steps.assign import assign_to_replicas
from dyn_plugin.plan.steps.bounds import critical_path_ms, ideal_ms
from dyn_plugin.plan.steps.instructions import check_plans, plan_from_json, plan_to_json
from dyn_plugin.plan.steps.microbatch import InfeasibleError, StageMemory
from dyn_plugin.plan.steps.pricing import make_micro_batch
from dyn_plugin.plan.steps.spec import planner_spec
from dyn_plugin.runtime.sampler import global_batches

CONFIG = load_config("examples/a100_gpt67b.json")
COST = build_cost_model(CONFIG.plugin.cost_model, CONFIG.plugin.cluster)
SPEC = planner_spec(COST, CONFIG.plugin, dp=2, zero_stage=1)
CODE = np.minimum(load_lengths("code"), 8192)
BATCHES = [[int(CODE[i]) for i in b] for b in global_batches(CODE, 65536, 3, seed=0)]


@pytest.fixture(scope="module")
def plans():
    return [plan_step(b, SPEC) for b in BATCHES]


def test_every_sample_once_equal_counts_within_memory(plans):
    for batch, plan in zip(BATCHES, plans):
        ids = sorted(i for mb in plan.micro_batches for i in mb.sample_ids)
        assert ids == list(range(len(batch)))
        counts = {len(r.micro_batches) for r in plan.replicas}
        assert len(counts) == 1, "ZeRO-2/3 need the same number of micro-batches on every replica"
        for r in plan.replicas:
            assert all(p <= m.budget for p, m in zip(r.sim.peak_bytes, SPEC.memory))
            for mb in r.micro_batches:
                assert list(mb.seq_lens) == [batch[i] for i in mb.sample_ids]


def test_deterministic(plans):
    assert plan_step(BATCHES[0], SPEC) == plans[0]


@pytest.mark.native
def test_native_matches_python(plans):
    assert plan_step(BATCHES[0], SPEC, native=False) == plans[0]


def test_beats_baselines_and_respects_bounds(plans):
    speedup = {name: [] for name in BASELINES}
    for batch, plan in zip(BATCHES, plans):
        assert plan.iteration_ms >= max(ideal_ms(batch, SPEC), critical_path_ms(batch, SPEC)) * (1 - 1e-9)
        for name in BASELINES:
            speedup[name].append(plan_baseline(name, batch, SPEC, 8192).iteration_ms / plan.iteration_ms)
    assert min(speedup["packing_varlen"]) >= 1.0, speedup  # never slower than the strongest baseline
    assert np.mean(speedup["packing_full"]) >= 1.15, speedup
    assert np.mean(speedup["fixed_padding"]) >= 2.0, speedup


def test_execution_plans_round_trip_and_match_up(plans):
    every = list(execution_plans(plans[0], 4096).values())
    assert sorted(p.rank for p in every) == list(range(SPEC.pp * SPEC.dp))
    check_plans(every)
    assert [plan_from_json(plan_to_json(p)) for p in every] == every


def test_assignment_balances_with_equal_counts():
    times = [9.0, 7.0, 6.0, 5.0, 4.0, 1.0]
    groups = assign_to_replicas(times, 2)
    assert sorted(sum(groups, [])) == list(range(6)) and [len(g) for g in groups] == [3, 3]
    assert abs(sum(times[i] for i in groups[0]) - sum(times[i] for i in groups[1])) <= 1.0
    with pytest.raises(ValueError, match="cannot be split evenly"):
        assign_to_replicas([1.0, 2.0, 3.0], 2)


def test_pack_rows_first_fit_decreasing():
    assert pack_rows([5, 3, 4, 2, 6], 8) == [[4, 3], [0, 1], [2]]
    with pytest.raises(ValueError, match="longer than the packing row"):
        pack_rows([9], 8)


def test_packing_varlen_is_priced_and_shaped_on_its_real_tokens():
    """Per-document attention needs no fill: a row is the tokens the collate concatenates."""
    plan = plan_baseline("packing_varlen", BATCHES[0], SPEC, 8192)
    assert plan.layout == "packed" and plan.padding_fraction == 0
    for mb in plan.micro_batches:
        assert mb.shape == (1, sum(mb.seq_lens))
        assert mb == make_micro_batch(mb.sample_ids, BATCHES[0], spec=SPEC, layout="packed", recompute=mb.recompute)


def test_pad_multiple_sets_padded_shapes_and_prices():
    mbc = CONFIG.plugin.microbatching.model_copy(update={"pad_multiple": 1024})
    spec = planner_spec(COST, CONFIG.plugin.model_copy(update={"microbatching": mbc}), dp=2, zero_stage=1)
    at8, wide = (make_micro_batch([0], [1100], spec=s, layout="padded", recompute="none") for s in (SPEC, spec))
    assert (at8.shape, wide.shape) == ((1, 1104), (1, 2048))
    assert sum(wide.forward_ms) > sum(at8.forward_ms) and sum(wide.backward_ms) > sum(at8.backward_ms)
    plan = plan_step(BATCHES[0], replace(spec, layouts=("padded",)))
    assert all(mb.shape[1] % 1024 == 0 for mb in plan.micro_batches)


@pytest.mark.native
def test_native_partition_pads_as_configured():
    """The C++ twin gets the configured pad_multiple too: it plans what the Python twin plans."""
    mbc = CONFIG.plugin.microbatching.model_copy(update={"pad_multiple": 1024})
    spec = planner_spec(COST, CONFIG.plugin.model_copy(update={"microbatching": mbc}), dp=2, zero_stage=1)
    padded = replace(spec, layouts=("padded",))
    assert plan_step(BATCHES[0], padded) == plan_step(BATCHES[0], padded, native=False)


def test_model_states_that_do_not_fit_are_a_clear_error():
    cfg = DynPluginConfig.model_validate({"pipeline": {"stages": 1}, "cluster": {"device": {"memory_mb": 36000}}})
    with pytest.raises(ValueError, match=r"pipeline stage 0 \(\d+ layers\) needs .* MB for model states"):
        planner_spec(COST, cfg, dp=1, zero_stage=0)


def test_plan_command(tmp_path, capsys):
    trace, plans_dir, png = tmp_path / "t.json", tmp_path / "plans", tmp_path / "p.png"
    rc = main(
        [
            "plan",
            "--config",
            "examples/a100_gpt67b.json",
            "--lengths",
            "code",
            "--steps",
            "1",
            "--trace",
            str(trace),
            "--plans",
            str(plans_dir),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    for name in ("dynapipe", *BASELINES):
        assert name in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("F") and e["ph"] == "X" for e in events)
    assert len(list(plans_dir.glob("rank*.json"))) == 8 and png.stat().st_size > 0
    assert main(["plan", "--config", "examples/a100_gpt67b.json", "--lengths", "code", "--steps", "1", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["method"] for r in records} == {"dynapipe", *BASELINES}


def test_plan_command_refuses_too_long_sequences(tmp_path, capsys):
    cfg = json.loads(open("examples/a100_gpt67b.json").read())
    cfg["dyn_plugin"]["microbatching"]["truncate"] = False
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    assert main(["plan", "--config", str(path), "--lengths", "code", "--steps", "1"]) == 2
    assert "exceeds microbatching.max_seq_len = 8192" in capsys.readouterr().err


def test_config_schedule_policy_is_honoured():
    from dataclasses import replace

    plain = plan_step(BATCHES[0], replace(SPEC, schedule="1f1b"))
    assert {r.schedule.name for r in plain.replicas} == {"1f1b"}
    assert plan_step(BATCHES[0], SPEC).iteration_ms <= plain.iteration_ms


def test_every_plan_pays_the_update_after_its_pipelines(plans):
    """The A100 profile measured no all-reduce: the gradients of the slowest stage go over the
    link between replicas (a ring moves 2 (dp-1)/dp of them); nor an optimizer step: left out."""
    grad_bytes = max(COST.stage_params(s) for s in SPEC.stages) * 2  # bf16 gradients
    dp_link = CONFIG.plugin.cluster.intra_node_gb_per_s  # pp=4 x dp=2 fill one 8-device node
    assert SPEC.update_ms == pytest.approx(grad_bytes * 2 * (2 - 1) / 2 / (dp_link * 1e9) * 1e3)
    for plan in plans:
        drained = max(r.sim.makespan_ms for r in plan.replicas)
        assert plan.iteration_ms == pytest.approx(drained + SPEC.update_ms)


def test_token_budget_groups_as_deepspeed_batch_by_seqlens():
    from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import batch_by_seqlens

    from dyn_plugin.plan.methods.baselines import budget_groups

    lengths = np.random.default_rng(0).integers(1, 500, size=300).tolist()
    for budget in (500, 2000, 9000):
        ours = budget_groups(lengths, budget)
        theirs = [ids for _, ids in batch_by_seqlens(lengths, budget)[0]]
        # DeepSpeed's loop stops one sequence short: its last micro-batch misses the final sequence,
        # which is kept here
        assert ours[: len(theirs) - 1] == theirs[:-1]
        assert ours[len(theirs) - 1][: len(theirs[-1])] == theirs[-1]
        assert sum(map(len, ours)) == len(lengths)
        assert all(sum(lengths[i] for i in g) <= budget for g in ours)


def test_a_sequence_only_the_packed_layout_fits_is_planned_packed():
    """Padding holds more than packing: where the longest sequence fits alone only when packed, the
    step plans it packed instead of failing on the padded layout."""
    mbc = CONFIG.plugin.microbatching.model_copy(update={"pad_multiple": 1024})
    one_stage = CONFIG.plugin.pipeline.model_copy(update={"stages": 1})
    spec = planner_spec(
        COST, CONFIG.plugin.model_copy(update={"microbatching": mbc, "pipeline": one_stage}), dp=4, zero_stage=3
    )
    lengths = [5000, 700, 300, 200, 150, 100, 90, 80]
    least = {
        layout: min(
            make_micro_batch([0], lengths, spec=spec, layout=layout, recompute=rc).peak_bytes[0]
            for rc in spec.recomputes
        )
        for layout in ("padded", "packed")
    }
    assert least["padded"] > least["packed"]  # 5000 tokens padded to 5120
    spec = replace(spec, memory=(StageMemory((least["padded"] + least["packed"]) / 2, 1),))
    plan = plan_step(lengths, spec)
    assert {mb.layout for r in plan.replicas for mb in r.micro_batches if 0 in mb.sample_ids} == {"packed"}
    with pytest.raises(InfeasibleError, match="does not fit in a padded micro-batch"):
        plan_step(lengths, replace(spec, layouts=("padded",)))


def test_a_host_that_cannot_cap_micro_batches_in_flight_gets_more_recompute_instead():
    """Megatron's 1F1B warms stage s up with pp - s - 1 forwards whatever the memory: without
    ``cap_in_flight`` a budget that the planner's own 1F1B meets by capping the micro-batches in
    flight is met by recomputing more, every order tried keeps every stage's natural warm-up, and
    an order that would overflow is not taken (a plan Megatron would run otherwise is never made;
    megatron_patches.schedule refuses one)."""
    from dyn_plugin.plan.steps.pricing import recompute_to_fit
    from dyn_plugin.plan.steps.schedule import choose_schedule, one_f_one_b
    from dyn_plugin.plan.steps.simulator import stage_peak_bytes

    mbs = tuple(
        make_micro_batch([i], {i: n}, spec=SPEC, layout="padded", recompute="none") for i, n in enumerate([2048] * 6)
    )
    natural = one_f_one_b(len(mbs), SPEC.pp)
    # what one micro-batch fewer in flight needs on every stage but the last (which holds one)
    fewer = one_f_one_b(len(mbs), SPEC.pp, max_in_flight=[max(1, SPEC.pp - s - 1) for s in range(SPEC.pp)])
    budget = [stage_peak_bytes(mbs, ops, s) for s, ops in enumerate(fewer.stages)]
    spec = replace(SPEC, memory=tuple(replace(m, budget=b) for m, b in zip(SPEC.memory, budget)))
    capped, _ = choose_schedule(mbs, spec.link, memory_budget=budget, policy="1f1b")
    assert capped.stages != natural.stages  # the planner's own 1F1B caps
    with pytest.raises(ValueError, match="as the host's 1F1B holds"):
        choose_schedule(mbs, spec.link, memory_budget=budget, policy="auto", capped=False)
    fitted = recompute_to_fit(mbs, natural, spec=spec)
    assert any(m.recompute != "none" for m in fitted)
    schedule, sim = choose_schedule(fitted, spec.link, memory_budget=budget, policy="auto", capped=False)
    assert schedule.stages == one_f_one_b(len(mbs), SPEC.pp, order=schedule.order).stages
    assert all(p <= b for p, b in zip(sim.peak_bytes, budget))
    plan = plan_step(BATCHES[0], replace(SPEC, cap_in_flight=False))
    for r in plan.replicas:  # the planner's own orders, each with its natural warm-ups
        assert r.schedule.stages == one_f_one_b(len(r.micro_batches), SPEC.pp, order=r.schedule.order).stages
    tiny = replace(SPEC, memory=tuple(replace(m, budget=1.0) for m in SPEC.memory))
    with pytest.raises(ValueError, match="cannot hold the micro-batches the host's 1F1B keeps in flight"):
        recompute_to_fit(mbs, natural, spec=tiny)


def test_the_optimizer_steps_fp32_gradients_must_fit_too():
    """Mixed precision: the step works on an fp32 copy of its partition's gradients, alive when no
    activation is; a device that holds the states but not the step is refused, naming it."""
    states = COST.model_state_bytes(zero_stage=1, dp=2)
    assert states.update == pytest.approx(4 * COST.stage_params() / 2)
    between = (states.total + states.update / 2) / 2**20

    def spec(memory_mb):
        cfg = DynPluginConfig.model_validate(
            {"cluster": {"device": {"memory_mb": memory_mb, "memory_fraction": 1.0, "allocator_margin": 0.0}}}
        )
        return planner_spec(COST, cfg, dp=2, zero_stage=1)

    with pytest.raises(ValueError, match="MB for model states and the optimizer step.s fp32 gradients"):
        spec(between)
    assert spec(states.update_peak / 2**20 + 1).memory[0].budget > 0
