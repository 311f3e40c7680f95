"""dyn_plugin.bench.train_megatron end to end, small: Megatron's padded and packed batchings and the plugin's
plan train the example's GPT on 2 gloo ranks, and the summary has a row per mode."""

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_megatron_comparison_trains_every_mode(tmp_path):
    out = tmp_path / "train"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "-m",
        "dyn_plugin.bench.train_megatron",
        "--out",
        str(out),
        "--steps",
        "1",
        "--max-len",
        "256",
        "--global-tokens",
        "2048",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((out / "summary.json").read_text())
    assert [r["mode"] for r in rows] == ["padded", "packing", "dyn_plugin"]
    for r in rows:
        assert r["steps"] == 1 and r["effective_tokens_per_s"] > 0 and r["predicted_step_ms"] > 0
        assert math.isfinite(r["final_loss"]) and 0 <= r["padding_fraction"] < 1
        assert r["speedup_vs_padded"] > 0 and r["speedup_vs_packing"] > 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["mode"] for r in records} == {"padded", "packing", "dyn_plugin"}
    # the same documents every way: each step scores the same real tokens
    assert len({r["real_tokens"] for r in records}) == 1
    assert (out / "report.md").read_text().startswith("# Training demo: megatron-core GPT")
    assert (out / "report.png").stat().st_size > 0
