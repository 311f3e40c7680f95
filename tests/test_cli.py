import json
import os
import subprocess
import sys

from dyn_plugin.cli import main
from dyn_plugin.cost.profile import load_profile


def test_report_json(capsys):
    assert main(["report", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for pkg in ("torch", "deepspeed", "transformers", "megatron-core", "highspy", "redis"):
        assert pkg in report["packages"]
    assert report["cpp_extension"].startswith(("active", "not built"))
    assert report["apex"].startswith(("present", "absent"))
    assert report["devices"][0].startswith("cpu")


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "dyn_plugin", "report"], capture_output=True, text=True, check=True)
    assert "cpp_extension" in out.stdout and "megatron-core" in out.stdout


def test_profile_command_writes_a_loadable_profile(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(
        [
            "profile",
            "--out",
            str(out),
            "--seq-lens",
            "16,64",
            "--micro-batch-sizes",
            "1,2",
            "--recompute",
            "none,full",
            "--repeats",
            "1",
            "--validate",
            "2",
            "--threads",
            "1",
            "--no-progress",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "padded/full/tp1" in text and "held-out: 2 random micro-batches" in text
    p = load_profile(out)
    assert {(t.layout, t.recompute) for t in p.tables} == {
        (l, r) for l in ("padded", "packed") for r in ("none", "full")
    }


def test_bad_arguments_are_clear_errors(tmp_path, capsys):
    assert main(["profile", "--out", str(tmp_path / "p.json"), "--recompute", "none,sometimes"]) == 2
    assert "allowed modes are none, selective, full" in capsys.readouterr().err
    assert main(["profile", "--out", str(tmp_path / "p.json"), "--model", "no-such-model"]) == 2
    assert "not a preset (tiny-llama, llama-350m, tiny-t5, tiny-gpt2)" in capsys.readouterr().err


def test_bench_cost_prints_json(capsys):
    assert main(["bench", "cost", "--queries", "300", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["benchmark"] == "cost" and record["python_us_per_query"] > 0
    if "native" not in record:  # the extension is built: both paths must agree exactly
        assert record["max_rel_diff_native_vs_python"] < 1e-12


def test_bench_checkpoint_prints_json_and_leaves_nothing(capsys, tmp_path):
    assert main(["bench", "checkpoint", "--size-mb", "3", "--files", "3", "--dir", str(tmp_path), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["benchmark"] == "checkpoint" and record["files"] == 3 and record["seal_mb_per_s"] > 0
    assert record["verify_hashes_s"] > 0 and list(tmp_path.iterdir()) == []


def test_pure_python_path_works_and_says_so():
    """Without the C++ extension the package still plans costs, and the report says which path runs."""
    code = (
        "import dyn_plugin, json;"
        "from dyn_plugin.commands.report import collect;"
        "from dyn_plugin.cost.analytic import analytic_cost_model;"
        "from dyn_plugin.config import ModelShape, DeviceSpec;"
        "m = analytic_cost_model(ModelShape(hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=128, vocab_size=100), DeviceSpec());"
        "assert m.native('packed', 'none') is None;"
        "print(json.dumps([collect()['cpp_extension'], m.micro_batch_cost([5, 7], layout='packed').forward_ms]))"
    )
    env = {**os.environ, "DYN_PLUGIN_FORCE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    status, fwd = json.loads(out.stdout)
    assert status.startswith("not built") and fwd > 0


def test_bench_loader_prints_json(capsys):
    assert main(["bench", "loader", "--steps", "3", "--step-ms", "0", "--planners", "1", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    modes = {r.get("mode") for r in records if r["benchmark"] == "loader"}
    assert modes == {"local", "tcp-store"}
    assert {r["backend"] for r in records if r["benchmark"] == "store-round-trip"} == {"tcp", "redis"}


def test_bench_planner_prints_json(capsys):
    assert (
        main(
            [
                "bench",
                "planner",
                "--distributions",
                "code",
                "--global-tokens",
                "65536",
                "--parallel",
                "4x2",
                "--batches",
                "1",
                "--python-batches",
                "1",
                "--json",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    methods = {(r["method"], r["impl"]) for r in records}
    assert ("dynapipe", "cpp" if dyn_plugin_native() else "python") in methods
    assert {m for m, _ in methods} == {
        "dynapipe",
        "dynapipe_all_or_nothing",
        "dynapipe_zero_bubble",
        "fixed_padding",
        "token_budget",
        "packing_full",
        "packing_varlen",
    }
    plan = next(r for r in records if r["method"] == "dynapipe")
    assert plan["sim_iter_ms"] >= plan["lower_bound_ms"] * (1 - 1e-9) and plan["plan_ms_p50"] > 0
    whole = next(r for r in records if r["method"] == "dynapipe_all_or_nothing")
    assert whole["pyramid_speedup"] >= 1.0  # pyramid checkpointing never slows a plan
    split = next(r for r in records if r["method"] == "dynapipe_zero_bubble")
    assert split["token_slices_what_if"]["speedup"] >= 1.0  # slices kept only where they pay


def test_bench_shard_prints_json(capsys):
    assert main(["bench", "shard", "--models", "gpt-48l", "--gpus", "16", "--budgets-mb", "30000", "--json"]) == 0
    records = {r["method"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(records) == {"osdp", "full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "best_uniform"}
    assert not records["no_shard"]["fits"]  # 48 replicated layers do not fit in 30 GB
    osdp = records["osdp"]
    assert osdp["layers"] == 48 and osdp["peak_mem_mb"] <= 30000 and osdp["knapsack_solves"] >= 1
    # every plan within the budget by its own estimate; the analytic model has no measured tables
    assert all(r["within_budget"] and r["peak_mem_mb_tables"] is None for r in records.values() if r["fits"])
    # the best uniform plan is at least as fast as each named one
    best = records["best_uniform"]
    assert all(best["sim_iter_ms"] <= r["sim_iter_ms"] for r in records.values() if r["fits"] and r is not osdp)
    assert osdp["speedup_vs_best_uniform"] >= 1.0
    # the search's plans include every uniform one, priced the same way: none of them is faster
    for r in records.values():
        if r["fits"]:
            assert osdp["sim_iter_ms"] <= r["sim_iter_ms"] * (1 + 1e-9), (osdp, r)


def dyn_plugin_native() -> bool:
    import dyn_plugin

    return dyn_plugin.native_available()


def test_bench_loader_at_scale_reports_startup_and_overhead(capsys):
    assert main(["bench", "loader", "--samples", "50000", "--steps", "3", "--json"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert record["benchmark"] == "loader-scale" and record["samples"] == 50000 and record["steps"] == 3
    assert 0 < record["startup_ms"] and 0 < record["overhead_ms_p50"] < record["plan_ms_p50"]


def test_bench_stores_without_redis_server_reports_tcp_and_says_how_to_add_redis(monkeypatch):
    from dyn_plugin.bench.store import bench_stores
    from dyn_plugin.store import redis_server

    def missing():
        raise redis_server.RedisServerNotFound("no redis-server binary found")

    monkeypatch.setattr(redis_server, "find_redis_server", missing)
    rows = bench_stores(count=3, payload_bytes=(1024,))
    assert [r["backend"] for r in rows] == ["tcp", "redis"] and rows[0]["p50_ms"] > 0
    assert "no redis-server binary found" in rows[1]["skipped"] and "--redis-url redis://" in rows[1]["skipped"]


def test_bench_stores_measure_a_given_redis_url(monkeypatch):
    from dyn_plugin.bench.store import bench_stores
    from dyn_plugin.store.redis_server import RedisServer

    with RedisServer() as server:
        monkeypatch.setenv("DYN_PLUGIN_REDIS_PASSWORD", server.password)
        rows = bench_stores(count=3, payload_bytes=(1024,), redis_url=server.url)
    assert [r["backend"] for r in rows] == ["tcp", "redis"] and rows[1]["p50_ms"] > 0


def test_bench_train_runs_without_a_profile_on_the_analytic_model(tmp_path, capsys, monkeypatch):
    """What a newcomer types: no --profile. The launch goes ahead on the analytic model and says so."""
    import subprocess as sp

    from dyn_plugin.bench.train_common import cost_model_section

    launched = []

    def fake_run(cmd, **kw):  # the comparison itself is test_deepspeed_ext's job: here, what it is asked to do
        launched.append(cmd)
        (tmp_path / "summary.json").write_text(json.dumps([{"mode": "dyn_plugin"}]))
        return sp.CompletedProcess(cmd, 0)

    monkeypatch.setattr(sp, "run", fake_run)
    assert main(["bench", "train", "--out", str(tmp_path), "--steps", "1", "--json"]) == 0
    (cmd,) = launched
    assert "dyn_plugin.bench.train_deepspeed" in cmd and "--profile" not in cmd
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert row["mode"] == "dyn_plugin" and row["cost_model"].startswith("analytic")
    assert cost_model_section(None, "fp32") == {"kind": "analytic", "dtype": "fp32"}
    assert cost_model_section("p.json", "bf16") == {"kind": "profile", "profile": "p.json", "dtype": "bf16"}
    (tmp_path / "p.json").write_text("{}")  # checked to exist when the command line is read
    profile = str(tmp_path / "p.json")
    assert main(["bench", "train", "--out", str(tmp_path), "--profile", profile]) == 0
    out = capsys.readouterr().out
    assert launched[1][-2:] == ["--profile", profile] and f"cost model: profile {profile}" in out
    # without --json the ranks' table is the output (make demo): no JSON records after it
    assert not [line for line in out.splitlines() if line.startswith("{")], out


def test_bench_train_host_megatron_launches_megatrons_comparison(tmp_path, capsys, monkeypatch):
    """--host megatron runs dyn_plugin.bench.train_megatron (a subprocess: the CLI never imports it); --sp is
    refused."""
    import subprocess as sp

    launched = []

    def fake_run(cmd, **kw):
        launched.append(cmd)
        (tmp_path / "summary.json").write_text(json.dumps([{"mode": "dyn_plugin"}]))
        return sp.CompletedProcess(cmd, 0)

    monkeypatch.setattr(sp, "run", fake_run)
    assert main(["bench", "train", "--host", "megatron", "--out", str(tmp_path), "--steps", "1", "--json"]) == 0
    (cmd,) = launched
    assert cmd[cmd.index("-m", 3) + 1] == "dyn_plugin.bench.train_megatron"
    assert cmd[cmd.index("--max-len") + 1] == "4096"
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert row["benchmark"] == "train-megatron" and row["mode"] == "dyn_plugin"
    assert main(["bench", "train", "--host", "megatron", "--sp", "--out", str(tmp_path)]) == 2
    assert "--sp compares sequence-parallel plans with --host deepspeed only" in capsys.readouterr().err
    assert len(launched) == 1


def test_plan_header_names_the_card_measured_and_the_card_planned_for(capsys):
    """The bundled tables were measured on a 40 GB A100, the example plans for an 80 GB one: the header says
    both, and the limit the peaks are read against."""
    assert main(["plan", "--config", "examples/a100_gpt67b.json", "--lengths", "code", "--steps", "1"]) == 0
    costs, layout = capsys.readouterr().out.splitlines()[:2]
    assert costs.startswith("gpt-6.7b, costs measured on AWS p4d: NVIDIA A100 40GB; plans for A100-80GB: 72,000 MB")
    assert "peaks up to 66.0 GiB" in costs and layout.startswith("pp=4 dp=2 ZeRO-1")


def test_shard_command_prints_and_writes_the_plan(tmp_path, capsys):
    from dyn_plugin.plan.sharding.shard_plan import ShardPlan

    out, png = tmp_path / "plan.json", tmp_path / "frontier.png"
    rc = main(
        [
            "shard",
            "--model",
            "examples/gpt-6.7b.json",
            "--config",
            "examples/a100_gpt67b_shard.json",
            "--out",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    # one row per kind of unit: the 32 layers' MLPs fold into one row
    assert "transformer.h." in text and "x32" in text and "simulated step:" in text and png.stat().st_size > 0
    plan = ShardPlan.load(out)
    assert plan.world == 16 and plan.peak_bytes <= plan.memory_budget_bytes and len(plan.units) == 67
    assert plan.frontier and all(a[1] >= b[1] for a, b in zip(plan.frontier, plan.frontier[1:]))


def test_shard_command_searches_an_encoder_decoder_over_pairs_priced_by_the_configs_tables(tmp_path, capsys):
    """T5-11B on one node of A100s: its sublayers are the units, the bundled 'tasks' pairs the
    typical step, the config's bundled T5-11B tables the prices (recording no model: a warning)."""
    from dyn_plugin.plan.sharding.shard_plan import ShardPlan

    config = json.loads(open("examples/a100_t5_11b_shard.json").read())
    config["dyn_plugin"]["microbatching"]["global_tokens"] = 16384
    config["dyn_plugin"]["cluster"]["num_nodes"] = 1
    path, out = tmp_path / "ds.json", tmp_path / "plan.json"
    path.write_text(json.dumps(config))
    assert main(["shard", "--model", "examples/t5-11b.json", "--config", str(path), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "encoder.block." in text and "decoder.block." in text and "x23" in text
    plan = ShardPlan.load(out)
    assert plan.world == 8 and plan.dtype == "fp16" and plan.peak_bytes <= plan.memory_budget_bytes
    assert len(plan.units) == 24 * 2 + 24 * 3 + 1  # self-attention and feed-forward per encoder block, + cross


def test_shard_command_says_the_minimum_budget(tmp_path, capsys):
    config = json.loads(open("examples/a100_gpt67b_shard.json").read())
    config["dyn_plugin"]["sharding"]["memory_budget_mb"] = 8000
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    assert (
        main(["shard", "--model", "examples/gpt-6.7b.json", "--config", str(path), "--out", str(tmp_path / "p.json")])
        == 2
    )
    err = capsys.readouterr().err
    assert "below the smallest possible sharding plan" in err and "sharding.memory_budget_mb" in err


def test_strategy_command_prints_writes_and_caches(tmp_path, capsys):
    from dyn_plugin.plan.strategies.strategy import Proposal

    out, png, cache = tmp_path / "s.json", tmp_path / "s.png", tmp_path / "cache"
    args = [
        "strategy",
        "code",
        "--gpus",
        "16",
        "--model",
        "gpt-6.7b",
        "--max-len",
        "16384",
        "--out",
        str(out),
        "--cache",
        str(cache),
    ]
    assert main(args + ["--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "strategies for gpt-6.7b on 16 GPUs" in text and png.stat().st_size > 0
    proposal = Proposal.load(out)
    assert all(s.gpus <= 16 for s in proposal.strategies) and (cache / f"strategy-{proposal.key}.json").exists()
    assert main(args) == 0 and Proposal.load(out) == proposal  # from the cache
    # a run's config: strategies it can execute (its 4 stages; groups of its sequence-parallel sizes)
    assert main(["strategy", "code", "--config", "examples/a100_gpt67b_sp.json", "--out", str(out)]) == 0
    assert all(s.runnable(1, 4) and s.gpus == 32 for s in Proposal.load(out).strategies)
    assert main(["strategy", "code", "--out", str(out)]) == 2
    assert "give --model NAME" in capsys.readouterr().err


def test_bench_strategy_prints_every_method(capsys):
    assert (
        main(
            [
                "bench",
                "strategy",
                "--distributions",
                "code",
                "--gpus",
                "16",
                "--max-len",
                "16384",
                "--tokens-per-gpu",
                "2048",
                "--batches",
                "2",
                "--json",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["method"] for r in rows] == ["hydraulis", "seed_stage1", "homogeneous_best", "dynapipe"]
    hydra, seed, homo = rows[0], rows[1], rows[2]
    assert hydra["dispatch_ms"] <= seed["dispatch_ms"] * (1 + 1e-9)
    assert homo["speedup_vs_homogeneous"] == 1.0 and hydra["sim_iter_ms"] >= hydra["bound_ms"] * (1 - 1e-9)
    for r in rows:  # memory by the cost model and by the measured tables, each against the device's limit
        if r.get("infeasible"):
            continue
        assert r["memory_limit_mb"] == 36000 and r["memory_budget_mb"] in [36000 * (1 - 0.08 * i) for i in range(4)]
        assert r["fits"] == (r["peak_mem_mb"] <= 36000 * (1 + 1e-9))
        assert r["fits_tables"] == (r["peak_mem_mb_tables"] <= 36000 * (1 + 1e-9))
