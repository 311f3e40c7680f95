"""The Hugging Face ``Trainer`` benchmark (dyn_plugin/bench/train_hf.py): ``dynplugin bench train --host
hf-trainer`` end to end, small: the stock Trainer padded, TRL's packing, the plugin through the Trainer
and in its own loop, on 2 ranks."""

import json

import pytest


def test_bench_train_hf_trainer_runs_the_four_modes(tmp_path, capsys):
    from dyn_plugin.cli import main

    args = ["bench", "train", "--host", "hf-trainer", "--out", str(tmp_path / "hf"), "--steps", "1"]
    assert main(args + ["--max-len", "512", "--global-tokens", "2048", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["mode"] for r in rows] == ["padded", "trl_packing", "dyn_plugin", "dyn_plugin_loop"]
    assert all(r["effective_tokens_per_s"] > 0 and r["benchmark"] == "train-hf" for r in rows)
    planned = {r["mode"]: r for r in rows if r["predicted_step_ms"] is not None}
    assert set(planned) == {"dyn_plugin", "dyn_plugin_loop"}  # the baselines run no plan
    # the same plans and the same optimizer steps, through the Trainer or the plugin's own loop
    assert planned["dyn_plugin"]["final_loss"] == pytest.approx(planned["dyn_plugin_loop"]["final_loss"], rel=1e-4)
    assert rows[0]["speedup_vs_trl_packing"] > 0 and rows[2]["speedup_vs_dyn_plugin_loop"] > 0


def test_unknown_modes_are_refused_with_the_hosts_list(capsys):
    from dyn_plugin.cli import main

    assert main(["bench", "train", "--host", "hf-trainer", "--modes", "padded,bogus"]) == 2
    assert "unknown bogus; choose from padded, trl_packing, dyn_plugin, dyn_plugin_loop" in capsys.readouterr().err
