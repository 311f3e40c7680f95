"""Activation memory read straight off the measured A100 tables (cost/table_memory.py), and the
bench shard records that price each plan by them beside its own estimate (issue 24)."""

from __future__ import annotations

import json

import pytest

from dyn_plugin.cli import main
from dyn_plugin.cost.bundled import MEASURED_DIR
from dyn_plugin.cost.table_memory import MB, MeasuredLayerMemory


def test_measured_points_are_read_as_measured_and_lines_between_them_lie_above():
    tables = MeasuredLayerMemory(MEASURED_DIR / "a100-gpt-6.7b.json")
    raw = json.loads((MEASURED_DIR / "a100-gpt-6.7b.json").read_text())
    full = next(t for t in raw["tables"] if t["tp"] == 1 and t["recompute"] == "full")
    peak = {s: v for s, b, v in full["peak_activation_mb"]["encoder"] if b == 1}
    assert tables.sequence(8192, "full")[1] == pytest.approx(peak[8192] * MB)  # 15,650 MB: the point
    # halfway between two measured lengths: the bytes per token halfway, below the chord of the convex points
    mid = tables.sequence(6144 + 1024, "full")[1]
    assert mid == pytest.approx(7168 * (peak[6144] / 6144 + peak[8192] / 8192) / 2 * MB)
    assert mid <= (peak[6144] + peak[8192]) / 2 * MB
    # below the shortest measured length: its bytes per token
    assert tables.sequence(8, "full")[1] == pytest.approx(tables.sequence(16, "full")[1] / 2)
    # a micro-batch sums its sequences (as a padded batch's rows add up)
    stored, extra = tables.micro_batch([1024, 1024], "none")
    one = tables.sequence(1024, "none")
    assert stored == pytest.approx(2 * one[0]) and extra == pytest.approx(2 * (one[1] - one[0]))
    # beyond the longest measured length the bytes per token run on along their last line
    assert tables.longest("full") == 8192
    per_token = [tables.sequence(n, "full")[1] / n for n in (6144, 8192, 10240, 12288)]
    assert per_token[2] - per_token[1] == pytest.approx(per_token[1] - per_token[0])
    assert per_token[3] - per_token[2] == pytest.approx(per_token[1] - per_token[0])


def test_bench_shard_prices_each_plan_by_the_measured_tables(capsys):
    assert main(["bench", "shard", "--models", "gpt-6.7b", "--gpus", "16", "--budgets-mb", "32000", "--json"]) == 0
    records = {r["method"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    osdp = records["osdp"]
    assert osdp["fits"] and osdp["within_budget"]
    # the plan's own estimate and the tables agree to a few percent on the step the loader plans
    assert osdp["peak_mem_mb_tables"] == pytest.approx(osdp["peak_mem_mb"], rel=0.05)
    assert osdp["within_budget_tables"] == (osdp["peak_mem_mb_tables"] <= 32000)
    assert osdp["speedup_vs_best_uniform"] >= 1.0
