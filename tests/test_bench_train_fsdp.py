"""The sharding plans trained side by side (dyn_plugin/bench/train_fsdp.py), small: 2 CPU ranks, real
code token ids, the analytic cost model, one timed step per method."""

import json

import pytest

from dyn_plugin.cli import main
from dyn_plugin.config import load_config
from dyn_plugin.cost.from_config import live_cost_model, model_shape
from dyn_plugin.models.hf import build_causal_lm, load_model_config
from dyn_plugin.models.shard_units import shard_units
from dyn_plugin.plan.sharding.search import BASELINES, uniform_plan

MAX_LEN, GLOBAL_TOKENS = 256, 1024
BUDGET_MB = 64  # fits the sharded plans beside a 256-token sequence, not every module replicated (59 + 24 MB)


def test_bench_shard_train_reports_every_method_and_osdp_stays_under_its_budget(tmp_path, capsys):
    out = tmp_path / "shard"
    assert (
        main(
            [
                "bench",
                "shard",
                "--train",
                "--out",
                str(out),
                "--steps",
                "1",
                "--max-len",
                str(MAX_LEN),
                "--global-tokens",
                str(GLOBAL_TOKENS),
                "--budget-mb",
                str(BUDGET_MB),
                "--json",
            ]
        )
        == 0
    )
    rows = {
        r["method"]: r
        for r in (json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{"))
    }
    assert list(rows) == ["osdp", "full_shard", "shard_grad_op", "no_shard"]
    assert not rows["no_shard"]["fits"] and "does not fit" in rows["no_shard"]["reason"]
    ran = [r for r in rows.values() if r["fits"]]
    assert [r["method"] for r in ran] == ["osdp", "full_shard", "shard_grad_op"]
    for r in ran:
        assert r["benchmark"] == "shard-train" and r["cost_model"].startswith("analytic"), r
        assert r["gpus"] == 2 and r["memory_budget_mb"] == BUDGET_MB and r["layers"] == 4, r
        assert r["effective_tokens_per_s"] > 0 and r["measured_step_ms"] > 0 and r["sim_iter_ms"] > 0, r
        assert r["micro_batches"] >= 1 and r["speedup_vs_full_shard"] > 0, r
        assert len(r["measured_peak_mb_per_rank"]) == 2 and r["predicted_peak_mb"] > 0, r
    osdp = rows["osdp"]
    assert "search_ms" in osdp and "knapsack_ms" in osdp  # the search's own timings
    assert osdp["measured_peak_mb"] < BUDGET_MB and osdp["under_budget"], osdp
    # the same initial weights and global batches: the same first-step loss whatever the sharding
    assert len({round(r["final_loss"], 4) for r in ran}) == 1, [r["final_loss"] for r in ran]
    report = (out / "report.md").read_text()
    assert all(f"| {method} | {'yes' if r['fits'] else 'no'} |" in report for method, r in rows.items())
    assert "no_shard does not fit" in report
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert sorted(r["method"] for r in records) == ["full_shard", "osdp", "shard_grad_op"]  # one timed step each


def test_the_default_budget_is_the_largest_at_which_no_shard_does_not_fit():
    from dyn_plugin.bench.train_fsdp import tightest_budget_mb

    model = build_causal_lm(load_model_config("tiny-llama"))
    units = shard_units(model)

    def plugin(budget_mb):
        return load_config(
            {
                "dyn_plugin": {
                    "cost_model": {"kind": "analytic", "dtype": "fp32"},
                    "microbatching": {"global_tokens": GLOBAL_TOKENS, "max_seq_len": MAX_LEN, "truncate": True},
                    "cluster": {"devices_per_node": 2, "device": {"memory_mb": budget_mb, "memory_fraction": 1.0}},
                    "sharding": {"enabled": True, "memory_budget_mb": budget_mb},
                }
            }
        ).plugin

    roomy = plugin(1e9)
    cost = live_cost_model(roomy.cost_model, roomy.cluster, model_shape(model))
    batch = [MAX_LEN, 100, 60]
    budget = tightest_budget_mb(units, cost, roomy, batch, 2)
    with pytest.raises(ValueError, match="every module replicate over 2 ranks does not fit"):
        uniform_plan(units, cost, plugin(budget), BASELINES["no_shard"], world=2, lengths=batch)
    assert uniform_plan(units, cost, plugin(budget + 1), BASELINES["no_shard"], world=2, lengths=batch).world == 2
