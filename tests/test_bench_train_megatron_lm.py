"""``dynplugin bench train --host megatron-lm`` end to end, tiny: Megatron-LM's own pretrain_gpt.py trains padded
(the plugin's fixed_padding), alone on its GPTDataset samples (with Megatron's local attention and with
SDPA) and under the plugin's plan on 2 gloo ranks, and
the JSON rows and records are complete and sane."""

import json
import math
import os
import subprocess
import sys

import pytest

from shared_data import megatron_lm

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ["padded", "megatron-lm", "megatron-lm-sdpa", "dyn_plugin"]


def bench(tmp_path, *modes: str, load: int = 0) -> tuple[dict[str, dict], list[dict], object]:
    """(rows by mode, per-step records, output folder) of the benchmark over ``modes`` (the default without),
    ``load`` busy processes beside it."""
    mlm = str(megatron_lm())  # skipped without a checkout (failed under CI)
    out = tmp_path / "train"
    # 1024-token rows, 2 per iteration: the shorter documents of the corpus leave padded rows part empty
    cmd = [sys.executable, "-m", "dyn_plugin", "bench", "train", "--host", "megatron-lm", "--megatron-lm", mlm]
    cmd += ["--out", str(out), "--steps", "1", "--max-len", "1024", "--global-tokens", "2048", "--json"]
    cmd += ["--modes", ",".join(modes)] if modes else []
    cmd += ["--background-load", str(load)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["mode"]: r for r in map(json.loads, done.stdout.splitlines())}
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    for r in rows.values():
        assert r["benchmark"] == "train-megatron-lm" and r["steps"] == 1 and r["background_load"] == load
        assert r["effective_tokens_per_s"] > 0 and r["measured_step_ms"] > 0 and math.isfinite(r["final_loss"])
    for mode in {"padded", "dyn_plugin"} & set(rows):  # the plans made inside the ranks reported their predictions
        assert rows[mode]["predicted_step_ms"] > 0 and rows[mode]["prediction_mape"] >= 0
    assert all(r["token_slots"] <= 2048 for r in records)  # one iteration's budget in every mode
    assert (out / "report.md").read_text().startswith("# Training demo: Megatron-LM's pretrain_gpt.py")
    assert (out / "code-1024.idx").stat().st_size > 0  # the corpus as a Megatron indexed dataset
    return rows, records, out


def test_the_plugins_two_modes_train_the_same_documents_and_compare(tmp_path):
    """The suite's share: the plugin's padded and planned runs (Megatron-LM's own two in the slow test)."""
    rows, records, _ = bench(tmp_path, "padded", "dyn_plugin")
    assert list(rows) == ["padded", "dyn_plugin"] and [r["mode"] for r in records] == ["padded", "dyn_plugin"]
    assert rows["dyn_plugin"]["speedup_vs_padded"] > 0 and "speedup_vs_megatron-lm" not in rows["dyn_plugin"]
    # the timed step's documents are code truncated at 1024 tokens, which the full global batches (the
    # loader's lookahead) fill rows with: that the padded mode pads shows in the slow test's longer rows
    assert rows["dyn_plugin"]["padding_fraction"] < 0.01
    assert records[0]["real_tokens"] == records[1]["real_tokens"]


@pytest.mark.slow  # within the suite's time: two more pretrain_gpt.py runs, Megatron-LM's own samples
def test_megatron_lm_comparison_trains_every_mode(tmp_path):
    """Every mode, under one busy process (--background-load), which adds the plugin without online calibration."""
    rows, records, out = bench(tmp_path, load=1)
    assert list(rows) == MODES + ["dyn_plugin_static"] and [r["mode"] for r in records] == list(rows)
    static = json.loads((out / "dyn_plugin_static" / "dyn_plugin.json").read_text())["dyn_plugin"]
    assert static["calibration"] == {"enabled": False} and "speedup_vs_dyn_plugin_static" in rows["dyn_plugin"]
    for r in rows.values():
        assert r["speedup_vs_padded"] > 0 and r["speedup_vs_megatron-lm"] > 0 and r["speedup_vs_megatron-lm-sdpa"] > 0
    for mode in ("megatron-lm", "megatron-lm-sdpa"):  # Megatron-LM's own samples: no plan, no padding
        assert rows[mode]["predicted_step_ms"] is None and rows[mode]["padding_fraction"] == 0
    # code truncated at 1024 tokens, in full global batches (the loader's lookahead): the timed step's
    # documents are mostly 1024 long, so padding pads little here, never less than the plan
    assert rows["padded"]["padding_fraction"] >= rows["dyn_plugin"]["padding_fraction"]
    assert rows["dyn_plugin"]["padding_fraction"] < 0.01
    # the plugin's two modes train the same documents
    assert records[0]["real_tokens"] == records[3]["real_tokens"]


def test_an_unknown_mode_is_refused_with_the_hosts_list(tmp_path):
    """Refused before anything runs, so no Megatron-LM is needed: a stand-in checkout (never run) is named,
    as without one the command would refuse the missing checkout first (or use ../shared's)."""
    checkout = tmp_path / "stand-in"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text("raise SystemExit('a stand-in, never run')\n")
    cmd = [sys.executable, "-m", "dyn_plugin", "bench", "train", "--host", "megatron-lm", "--modes", "padded,nope"]
    cmd += ["--megatron-lm", str(checkout), "--out", str(tmp_path / "out")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--modes: unknown nope" in done.stderr and "megatron-lm-sdpa" in done.stderr


def test_missing_checkout_names_the_option(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "dyn_plugin",
        "bench",
        "train",
        "--host",
        "megatron-lm",
        "--megatron-lm",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--megatron-lm" in done.stderr and "pretrain_gpt.py" in done.stderr
