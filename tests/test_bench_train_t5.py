"""`dynplugin bench train --model t5` end to end, small: the tiny T5 profiled on a tiny grid, then
trained under DeepSpeed on 2 gloo ranks on the bundled 'tasks' pairs, every batching side by side."""

import json

import pytest

from dyn_plugin.bench.train_pairs import MODES, trainable_modes
from dyn_plugin.cli import main
from dyn_plugin.models.hf import PRESETS


def test_bench_train_t5_runs_the_comparison(tmp_path, capsys):
    """Every mode, dyn_plugin_static too: one busy process beside the training (--background-load) adds it."""
    profile = tmp_path / "t5.json"
    grid = ["--seq-lens", "16,32", "--micro-batch-sizes", "1,4,8", "--max-tokens", "256", "--repeats", "1"]
    argv = ["profile", "--model", "tiny-t5", "--out", str(profile), "--recompute", "none", "--validate", "0"]
    assert main(argv + grid + ["--threads", "1", "--no-progress"]) == 0
    capsys.readouterr()
    out = tmp_path / "train"
    argv = ["bench", "train", "--model", "t5", "--profile", str(profile), "--out", str(out)]
    flags = ["--steps", "1", "--max-len", "32", "--global-tokens", "512", "--background-load", "1", "--json"]
    assert main(argv + flags) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["mode"] for r in rows] == trainable_modes()
    assert {"padded", "token_budget", "packing", "dyn_plugin", "dyn_plugin_static"} <= set(trainable_modes())
    assert set(trainable_modes()) <= set(MODES)
    for r in rows:
        assert r["benchmark"] == "train-t5" and r["steps"] == 1 and r["background_load"] == 1
        assert r["effective_tokens_per_s"] > 0 and r["predicted_step_ms"] > 0
        assert r["prediction_mape"] is not None and 0 <= r["padding_fraction"] < 1
    plugin = next(r for r in rows if r["mode"] == "dyn_plugin")
    assert {
        "speedup_vs_padded",
        "speedup_vs_token_budget",
        "speedup_vs_packing",
        "speedup_vs_dyn_plugin_static",
    } <= set(plugin)
    # the same global batches: every mode trained the same real tokens
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len({r["real_tokens"] for r in records}) == 1
    assert (out / "report.md").exists()


def test_bench_train_t5_needs_a_profile(tmp_path, capsys):
    assert main(["bench", "train", "--model", "t5", "--out", str(tmp_path)]) != 0
    assert "dynplugin profile --model tiny-t5" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--host", "megatron"], ["--sp"]])
def test_bench_train_t5_is_deepspeed_data_parallel(tmp_path, capsys, flags):
    profile = tmp_path / "p.json"
    profile.write_text("{}")
    assert main(["bench", "train", "--model", "t5", "--profile", str(profile), *flags]) != 0
    assert "--model t5 trains under DeepSpeed" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, says",
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "no decoder tables of (input, target) pairs"),
        ('{"model": {"config": {}}}', "no decoder tables of (input, target) pairs"),
        ("a100", "not a CPU profile of an encoder-decoder"),  # tables of pairs, but no model to build
        ("a100-without-tp", "its tables are incomplete or malformed"),
        ("a100-fp16", "measured in fp16, but the run trains in fp32"),  # as every rank's initialize refuses it
    ],
)
def test_a_bad_profile_is_refused_by_name_before_any_rank_starts(tmp_path, content, says):
    from dyn_plugin.bench.train_pairs import cpu_pair_profile

    if content.startswith("a100"):
        from dyn_plugin.cost.bundled import PAIR_TABLES

        raw = json.loads(PAIR_TABLES["a100-t5-11b"].read_text())
        if content == "a100-without-tp":
            raw["model"] = {"config": {"model_type": "t5"}}
            del raw["tables"][0]["tp"]
        if content == "a100-fp16":  # the A100 tables (fp16) as if measured on tiny T5
            raw["model"] = {"config": PRESETS["tiny-t5"]}
        content = json.dumps(raw)
    bad = tmp_path / "p.json"
    bad.write_text(content)
    with pytest.raises(SystemExit) as refused:
        cpu_pair_profile(str(bad))
    assert says in str(refused.value) and "dynplugin profile --model tiny-t5" in str(refused.value)
    with pytest.raises(SystemExit, match="does not exist"):
        cpu_pair_profile(str(tmp_path / "missing.json"))


def test_background_load_is_refused_by_name_where_the_bench_has_no_static_mode(tmp_path, capsys):
    assert main(["bench", "train", "--host", "hf-trainer", "--background-load", "1", "--out", str(tmp_path)]) != 0
    assert "with another host or --sp, drop --background-load" in capsys.readouterr().err
