"""The DeepSpeed training benchmark (dyn_plugin/bench/train_deepspeed.py): ``dynplugin bench train``
end to end, small, and its device settings (DeepSpeed's precision section follows the profile's
dtype, and the planner's memory is the device's)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from dyn_plugin.bench.train_deepspeed import device_memory_mb, precision_section


def test_precision_section_follows_the_profile_dtype():
    assert precision_section("fp32") == {}  # the CPU demo's config stays as it was
    assert precision_section("bf16") == {"bf16": {"enabled": True}}
    assert precision_section("fp16") == {"fp16": {"enabled": True}}


def test_cuda_memory_is_the_gpus(monkeypatch):
    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    assert device_memory_mb(torch.device("cuda", 0)) == 80 * 1024
    assert device_memory_mb(torch.device("cpu")) == 8000


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    """The tiny Llama profiled on a tiny grid (the plans need a profile; its accuracy is not at stake here)."""
    from dyn_plugin.cli import main

    profile = tmp_path_factory.mktemp("profile") / "profile.json"
    assert (
        main(
            [
                "profile",
                "--out",
                str(profile),
                "--seq-lens",
                "16,1024",
                "--micro-batch-sizes",
                "1,2",
                "--max-tokens",
                "2048",
                "--recompute",
                "none",
                "--repeats",
                "1",
                "--validate",
                "0",
                "--threads",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    return profile


def test_bench_train_runs_the_comparison(profile, tmp_path, capsys):
    """`make demo`'s main job, small: the tiny Llama trained five ways on 2 ranks."""
    from dyn_plugin.cli import main

    assert (
        main(
            [
                "bench",
                "train",
                "--profile",
                str(profile),
                "--out",
                str(tmp_path / "train"),
                "--steps",
                "1",
                "--max-len",
                "1024",
                "--global-tokens",
                "4096",
                "--json",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["mode"] for r in rows] == ["padded", "token_budget", "packing", "packing_varlen", "dyn_plugin"]
    assert all(r["effective_tokens_per_s"] > 0 and r["predicted_step_ms"] > 0 for r in rows)
    # exact token-mean updates: the same loss every way, except where documents attend across a packed row
    assert len({round(r["final_loss"], 4) for r in rows if r["mode"] != "packing"}) == 1
    assert (tmp_path / "train" / "report.png").stat().st_size > 0
    events = json.loads((tmp_path / "train" / "step-trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1} and {e["pid"] for e in spans} == {0, 1}  # measured, predicted; 2 ranks


def test_bench_train_on_pipeline_stages_runs_the_plugins_schedules_beside_1f1b(profile, tmp_path, capsys):
    """--stages 2: the two ranks are one pipeline; dyn_plugin plans its schedules (zero-bubble splits
    included) and dyn_plugin_1f1b runs the same micro-batches under 1F1B: the same training, exactly."""
    from dyn_plugin.cli import main

    args = ["bench", "train", "--profile", str(profile), "--out", str(tmp_path / "pipe"), "--steps", "1"]
    args += ["--max-len", "1024", "--global-tokens", "4096", "--stages", "2", "--json"]
    assert main(args + ["--modes", "dyn_plugin,dyn_plugin_1f1b"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["mode"] for r in rows] == ["dyn_plugin", "dyn_plugin_1f1b"]
    assert rows[0]["final_loss"] == pytest.approx(rows[1]["final_loss"], abs=1e-6)
    assert all(r["effective_tokens_per_s"] > 0 for r in rows)
    # one executed step per mode beside its simulation: each stage ran its passes in the planned order
    for mode in ("dyn_plugin", "dyn_plugin_1f1b"):
        events = json.loads((tmp_path / "pipe" / f"pipeline-trace-{mode}.json").read_text())["traceEvents"]
        for rank in (0, 1):
            passes = [
                [e["name"] for e in events if e["ph"] == "X" and e["pid"] == rank and e["tid"] == tid] for tid in (0, 1)
            ]
            executed = [n for n in passes[0] if n[0] in "FBIW" and n[1:].isdigit()]
            assert executed and executed == passes[1], (mode, rank, passes)
            assert "step" in passes[0] and all(e["dur"] >= 0 for e in events if e["ph"] == "X")
    assert main(["bench", "train", "--host", "megatron", "--stages", "2"]) == 2
    assert "--stages runs DeepSpeed's pipeline engine" in capsys.readouterr().err


@pytest.mark.slow  # within the suite's time: the module's --local_rank handling; torchrun launches it above
def test_bench_train_runs_under_deepspeeds_launcher(profile, tmp_path):
    # the same module under DeepSpeed's own launcher (which adds --local_rank)
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    done = subprocess.run(
        [
            launcher,
            "--num_gpus",
            "2",
            "--module",
            "dyn_plugin.bench.train_deepspeed",
            "--profile",
            str(profile),
            "--out",
            str(tmp_path / "ds"),
            "--steps",
            "1",
            "--max-len",
            "1024",
            "--global-tokens",
            "4096",
            "--modes",
            "dyn_plugin",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [r["mode"] for r in json.loads((tmp_path / "ds" / "summary.json").read_text())] == ["dyn_plugin"]


def test_modes_pick_the_batchings_and_an_unknown_one_is_refused_before_any_rank_starts(capsys):
    from dyn_plugin.cli import main

    assert main(["bench", "train", "--modes", "padded,packed", "--out", "/nonexistent/never-written"]) == 2
    err = capsys.readouterr().err
    assert "--modes: unknown packed" in err and "packing_varlen" in err
    assert main(["bench", "train", "--model", "t5", "--profile", __file__, "--modes", "sp_dynamic"]) == 2
    assert "--modes: unknown sp_dynamic" in capsys.readouterr().err  # a DeepSpeed batching the pairs lack


def test_a_finished_mode_lets_its_engine_go(profile, tmp_path, monkeypatch):
    """Each mode plans against the whole device: the one before must leave nothing behind. ZeRO's
    gradient hooks on the parameters' C++ accumulators tie the engine into a cycle that no collection
    frees until DeepSpeed's teardown runs (on the H200 a 1.2B model kept 16 GiB per mode and the fifth
    mode ran out of memory)."""
    import argparse
    import gc
    import weakref

    import numpy as np
    import torch.distributed as dist

    import deepspeed_ext
    from dyn_plugin.bench import train_deepspeed
    from dyn_plugin.child import free_port

    built, real = [], deepspeed_ext.initialize

    def initialize(**kwargs):
        out = real(**kwargs)
        built.append(weakref.ref(out[0]))
        return out

    monkeypatch.setattr(train_deepspeed.deepspeed_ext, "initialize", initialize)
    for name, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)  # what a launcher sets and DeepSpeed asserts
    deepspeed_ext.skip_cpu_shm_build()
    initialized_here = not dist.is_initialized()
    if initialized_here:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        rng = np.random.default_rng(0)
        lengths = rng.integers(8, 300, size=64)
        docs = [rng.integers(0, 1000, size=n) for n in lengths]
        args = argparse.Namespace(
            profile=str(profile), model="tiny-llama", global_tokens=2048, max_len=512, memory_mb=None, seed=0,
            warmup=0, steps=1, out=str(tmp_path), stages=1,
        )  # fmt: skip
        records = train_deepspeed.run_mode("dyn_plugin", args, docs, lengths, torch.device("cpu"), "fp32")
        assert len(records) == 1
        gc.collect()
        assert built and built[0]() is None, "the finished mode's DeepSpeed engine is still alive"
    finally:
        if initialized_here:
            dist.destroy_process_group()
