"""``dynplugin plan``: plan the global batches of a length file and compare with the baselines."""

from __future__ import annotations

import argparse
import json
import logging
from collections import Counter

from ..cli_args import RANKS, SEED, STEPS, TOKENS, input_file, output_dir, output_file

HELP = "plan global batches of a length distribution; per step: micro-batches, layout, recompute, time, bubble, memory, and the baselines"

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", required=True, type=input_file, help="DeepSpeed JSON config with a dyn_plugin section"
    )
    parser.add_argument(
        "--lengths", required=True, help="lengths .npy/.json, or a bundled distribution (code, prose, mixture)"
    )
    parser.add_argument(
        "--global-tokens", type=TOKENS, help="tokens per global batch (default: microbatching.global_tokens)"
    )
    parser.add_argument("--steps", type=STEPS, default=3, help="global batches to plan (default %(default)s)")
    parser.add_argument("--dp", type=RANKS, help="data-parallel replicas (default: cluster devices / pipeline stages)")
    parser.add_argument("--seed", type=SEED, default=0)
    parser.add_argument(
        "--trace",
        metavar="JSON",
        type=output_file,
        help="Chrome trace of the first step's plan (Perfetto, chrome://tracing)",
    )
    parser.add_argument("--plot", metavar="PNG", type=output_file, help="step time per method, as bars")
    parser.add_argument(
        "--plans", metavar="DIR", type=output_dir, help="write the first step's execution plans (one JSON per rank)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON record per step and method instead of tables")


def run(args: argparse.Namespace) -> int:

    from ..config import load_config
    from ..cost.from_config import build_cost_model
    from ..lengths.io import cap_lengths, load_lengths
    from ..plan.methods.baselines import BASELINES, SP_BASELINES, plan_baseline
    from ..plan.methods.planner import plan_step
    from ..plan.steps.bounds import critical_path_ms, ideal_ms
    from ..plan.steps.spec import planner_spec
    from ..runtime.sampler import global_batches

    cfg = load_config(args.config)
    plugin = cfg.plugin
    cost = build_cost_model(plugin.cost_model, plugin.cluster)
    pp = plugin.pipeline.stages
    dp = args.dp if args.dp is not None else max(1, plugin.cluster.world_size // pp)
    spec = planner_spec(cost, plugin, dp=dp, zero_stage=cfg.zero_stage, seed=args.seed)
    sp = plugin.sequence_parallel.enabled
    if sp:
        from dataclasses import replace

        plain = replace(spec, sp_sizes=(1,))
    max_len = plugin.microbatching.max_seq_len
    lengths = cap_lengths(load_lengths(args.lengths), max_len, plugin.microbatching.truncate)
    tokens = args.global_tokens if args.global_tokens is not None else plugin.microbatching.global_tokens
    batches = global_batches(lengths, tokens, args.steps, args.seed)
    records = []
    first_plan = None
    for step, ids in enumerate(batches):
        lens = [int(lengths[i]) for i in ids]
        if sp:  # the plugin with sequence parallelism, without it, and the systems that split sequences
            plans = {"dynamic_sp": plan_step(lens, spec)}
            try:
                plans["dynapipe"] = plan_step(lens, plain)
            except ValueError as exc:
                logger.warning("step %d: dynapipe without sequence parallelism infeasible: %s", step, exc)
        else:
            plans = {"dynapipe": plan_step(lens, spec)}
        for name in BASELINES + (SP_BASELINES if sp else ()):
            try:
                plans[name] = plan_baseline(name, lens, spec, max_len)
            except ValueError as exc:
                logger.warning("step %d: baseline %s infeasible: %s", step, name, exc)
        first_plan = first_plan or next(iter(plans.values()))
        ideal, bound = ideal_ms(lens, spec), critical_path_ms(lens, spec)
        for method, p in plans.items():
            records.append(
                {
                    "step": step,
                    "method": method,
                    "sequences": len(lens),
                    "tokens": sum(lens),
                    "micro_batches": len(p.micro_batches),
                    "layout": p.layout,
                    "groups": list(p.group_sizes),
                    "recompute": dict(Counter(mb.recompute for mb in p.micro_batches)),
                    "schedule": sorted({r.schedule.name for r in p.replicas}),
                    "predicted_ms": p.iteration_ms,
                    "bubble": p.bubble_fraction,
                    "peak_mem_bytes": p.peak_bytes,
                    "padding_fraction": p.padding_fraction,
                    "ideal_ms": ideal,
                    "lower_bound_ms": max(ideal, bound),
                }
            )
    if args.json:
        for r in records:
            print(json.dumps(r))
    else:
        print(_costs_and_device(cost.name, plugin))
        print(
            f"pp={pp} dp={dp} ZeRO-{cfg.zero_stage}, stages of {[s.num_layers for s in spec.stages]} layers, "
            f"{tokens:,} tokens per global batch of {args.lengths}"
        )
        _print_tables(records)
    if args.trace:
        _write_trace(first_plan, spec.link, args.trace)
        print(f"trace of step 0 -> {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    if args.plans:
        _write_plans(first_plan, spec, args.plans)
    if args.plot:
        _plot(records, args.plot)
        print(f"plot -> {args.plot}")
    return 0


def _costs_and_device(cost_name: str, plugin) -> str:
    """Which card the costs were measured on and which the plans are for: they may differ (the bundled
    A100 tables were measured on a 40 GB card, the example configs plan for an 80 GB one), and the
    peaks in the tables are to be read against the second."""
    device = plugin.cluster.device
    if plugin.cost_model.kind == "profile":
        model, _, card = cost_name.partition("@")  # a profile's cost model is named model@card (cost/profile.py)
        costs = f"{model}, costs measured on {card}"
    else:
        costs = f"{cost_name}, costs from the model's shape and the device's nominal figures"
    return (
        f"{costs}; plans for {device.name}: {device.memory_mb:,.0f} MB x {device.memory_fraction} usable per device, "
        f"peaks up to {device.plannable_mb / 1024:.1f} GiB (the allocator's margin left above them)"
    )


def _print_tables(records: list[dict]) -> None:
    header = (
        f"{'method':<19}{'mbs':>5}{'layout':>8}  {'groups':<12}{'recompute':<22}{'time ms':>10}{'vs ours':>8}"
        f"{'bubble':>8}{'peak GiB':>9}{'padding':>8}"
    )
    for step in sorted({r["step"] for r in records}):
        rows = [r for r in records if r["step"] == step]
        ours = rows[0]["predicted_ms"]
        print(
            f"\nstep {step}: {rows[0]['sequences']} sequences, {rows[0]['tokens']:,} tokens; ideal {rows[0]['ideal_ms']:.0f} ms, "
            f"lower bound {rows[0]['lower_bound_ms']:.0f} ms (longest sequence's critical path or ideal)"
        )
        print(header)
        for r in rows:
            rc = ",".join(f"{k}:{v}" for k, v in sorted(r["recompute"].items()))
            groups = ",".join(map(str, r["groups"]))
            print(
                f"{r['method']:<19}{r['micro_batches']:>5}{r['layout']:>8}  {groups:<12}{rc:<22}{r['predicted_ms']:>10.0f}"
                f"{r['predicted_ms'] / ours:>7.2f}x{r['bubble']:>8.1%}{r['peak_mem_bytes'] / 2**30:>9.1f}{r['padding_fraction']:>8.1%}"
            )


def _write_trace(plan, link, path: str) -> None:
    from ..plan.steps.simulator import simulate
    from ..plan.steps.trace import chrome_trace, write_chrome_trace

    traces = []
    for i, r in enumerate(plan.replicas):
        sim = simulate(r.micro_batches, r.schedule, link, record=True)
        traces.append(chrome_trace(sim, r.micro_batches, title=f"replica {i} ({r.schedule.name})", replica=i))
    write_chrome_trace(path, traces)


def _write_plans(plan, spec, directory: str) -> None:
    import os

    from ..atomic import write_atomic
    from ..plan.methods.planner import execution_plans
    from ..plan.steps.instructions import check_plans, plan_to_json

    os.makedirs(directory, exist_ok=True)
    every = list(execution_plans(plan, spec.hidden_size).values())
    check_plans(every)
    for p in every:
        write_atomic(os.path.join(directory, f"rank{p.rank}.json"), plan_to_json(p))
    print(f"execution plans of step 0 -> {directory}/rank*.json ({len(every)} ranks)")


def _plot(records: list[dict], path: str) -> None:
    import matplotlib

    from ..atomic import atomic_path

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    steps = sorted({r["step"] for r in records})
    methods = list(dict.fromkeys(r["method"] for r in records))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(methods)
    for k, m in enumerate(methods):
        ys = [
            next((r["predicted_ms"] / 1e3 for r in records if r["step"] == s and r["method"] == m), np.nan)
            for s in steps
        ]
        bars = ax.bar(np.arange(len(steps)) + k * width, ys, width, label=m)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    bound = [next(r["lower_bound_ms"] / 1e3 for r in records if r["step"] == s) for s in steps]
    for i, b in enumerate(bound):
        ax.hlines(b, i - 0.05, i + 0.85, colors="black", linestyles="dashed", label="lower bound" if i == 0 else None)
    ax.set_xticks(np.arange(len(steps)) + 0.4 - width / 2, [f"step {s}" for s in steps])
    ax.set_ylabel("predicted step time (s)")
    ax.set_title("Simulated step time per method (lower is better)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
    ax.legend(fontsize=8, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.08), frameon=False)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
