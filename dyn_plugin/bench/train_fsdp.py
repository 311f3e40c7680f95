"""Train a tiny Llama with FSDP2 under a memory budget, one sharding plan per method, side by side.

    python -m torch.distributed.run --nproc_per_node=2 -m dyn_plugin.bench.train_fsdp \\
        --profile out/profile.json --budget-mb 120 --out out/shard-train

Methods: ``osdp`` (the plan ``search_sharding`` finds for the budget) and FSDP's uniform
strategies ``full_shard``, ``shard_grad_op`` and ``no_shard`` (``uniform_plan``: every module
the same choice); a method whose plan cannot fit the budget is reported as not fitting. Each
trains the same model from the same initial weights on the same global batches (the Python
standard library's source, tokenized with the plugin's offline BPE) through the FSDP entry
(``initialize`` / ``train_step``), so only the sharding, and the micro-batches the planner cuts
for the memory the plan's model states leave, differ.

Warm-up step(s), then timed steps (barrier and one device synchronisation around each: the
step's kernels have run, not just been queued), the methods taking turns on each global batch so
that the load of other processes falls on all alike; effective tokens/s = real tokens / time.
Then, per method, in a separate short run (wrap + 2 steps), the peak memory per rank measured inside
``memory.measure()`` against the plan's prediction for those steps and the budget: on CPU that
measurement watches every op, which slows them, so it never shares a run with the timing.

Ranks run on CPU (gloo, fp32) or, where CUDA is available, one GPU each (NCCL) in the profile's
precision (bf16 without a profile). Rank 0 writes records.jsonl (per timed step), summary.json
(one row per method) and report.md. ``dynplugin bench shard --train`` launches it.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import time
from collections import Counter
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from ..atomic import write_atomic
from ..config import DynPluginConfig, load_config
from ..cost.from_config import live_cost_model, model_shape
from ..cost.table import TableCostModel
from ..fsdp.engine import initialize
from ..fsdp.memory import measure, predicted_peak_bytes
from ..fsdp.step import train_step
from ..models.hf import build_causal_lm, load_model_config
from ..models.shard_units import shard_units
from ..plan.sharding.search import BASELINES, search_sharding, smallest_activation, uniform_plan
from ..plan.sharding.shard_plan import MB, ShardPlan, ShardUnit
from ..plan.steps.spec import planner_spec
from ..profiling.device import DTYPES
from ..runtime.sampler import global_batches
from .train_common import (
    add_model_argument,
    common_parser,
    cost_model_label,
    cost_model_section,
    profile_dtype,
    ranks_on,
    synchronize,
    tokenized_corpus,
    use_rank_device,
    write_results,
)

METHODS = ("osdp",) + tuple(BASELINES)
ROOMY_MB = 1e9  # a budget nothing exceeds, to price before the budget is known
MEMORY_STEPS = 2  # steps of the peak-memory run: the first allocates the optimizer states, the second holds them
LR = 1e-3


def plugin_section(args: argparse.Namespace, dtype: str, world: int, budget_mb: float) -> dict[str, Any]:
    """The run's ``dyn_plugin`` section: the budget is the device's whole memory and the sharding budget."""
    sharding: dict[str, Any] = {"enabled": True, "host": "fsdp2", "memory_budget_mb": budget_mb}
    if args.overlap is not None:
        sharding["overlap"] = args.overlap
    return {
        "cost_model": cost_model_section(args.profile, dtype),
        "microbatching": {"global_tokens": args.global_tokens, "max_seq_len": args.max_len, "truncate": True},
        "cluster": {"devices_per_node": world, "device": {"memory_mb": budget_mb, "memory_fraction": 1.0}},
        "sharding": sharding,
    }


def fresh_model(args: argparse.Namespace, device: torch.device, dtype: str) -> torch.nn.Module:
    """The same initial weights for every method and run, on the device, in the training precision."""
    torch.manual_seed(args.seed)
    return build_causal_lm(load_model_config(args.model)).to(device=device, dtype=DTYPES[dtype])


def first_batch(lengths: np.ndarray, args: argparse.Namespace) -> list[int]:
    """The lengths of the run's first global batch: what the entry searches its plan for."""
    return [int(lengths[i]) for i in global_batches(lengths, args.global_tokens, 1, args.seed)[0]]


def tightest_budget_mb(
    units: list[ShardUnit], cost: TableCostModel, plugin: DynPluginConfig, batch: list[int], world: int
) -> int:
    """The largest whole MB per rank at which no_shard does not fit: 1 MB short of its model states
    plus the longest sequence's activations alone. There the search must choose what to shard,
    while keeping most modules gathered is still within reach."""
    replicated = uniform_plan(units, cost, plugin, BASELINES["no_shard"], world=world, lengths=batch)
    least = smallest_activation(batch, planner_spec(cost, plugin, dp=world, zero_stage=3, state_bytes=0.0))
    return math.ceil((replicated.state_bytes + least) / MB) - 1


def find_plan(
    method: str,
    units: list[ShardUnit],
    cost: TableCostModel,
    plugin: DynPluginConfig,
    args: argparse.Namespace,
    lengths: np.ndarray,
) -> tuple[ShardPlan | None, float, dict, str]:
    """(plan or None, milliseconds to find it, the search's timings, why it does not fit). Every
    rank finds the same plan (the search is deterministic), so ranks agree on which methods run."""
    world = dist.get_world_size()
    batch = first_batch(lengths, args)
    timings: dict = {}
    t0 = time.perf_counter()
    try:
        if method == "osdp":
            plan = search_sharding(
                units,
                cost,
                plugin,
                world=world,
                lengths=batch,
                host="fsdp2",
                model=args.model,
                timings=timings,
                longest=int(lengths.max()),
            )
        else:
            plan = uniform_plan(
                units,
                cost,
                plugin,
                BASELINES[method],
                world=world,
                lengths=batch,
                host="fsdp2",
                model=args.model,
                longest=int(lengths.max()),
            )
    except ValueError as exc:  # below the smallest plan, or a uniform strategy too big for the budget
        return None, 0.0, timings, str(exc)
    return plan, (time.perf_counter() - t0) * 1e3, timings, ""


def sharded(
    model, plan: ShardPlan, cost: TableCostModel, section: dict, args: argparse.Namespace, docs, lengths
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """``fsdp.initialize`` as every method here trains: FSDP2 under ``plan``, AdamW, the plugin's loader."""
    model, optimizer, loader, _ = initialize(
        model,
        {"dyn_plugin": section},
        [{"input_ids": d} for d in docs],
        lengths,
        shard_plan=plan,
        fsdp="fsdp2",
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR),
        cost_model=cost,
        seed=args.seed,
    )
    return model, optimizer, loader


def timed_runs(
    plans: dict[str, ShardPlan],
    cost: TableCostModel,
    section: dict,
    args: argparse.Namespace,
    docs,
    lengths,
    device: torch.device,
    dtype: str,
) -> list[dict]:
    """Warm-up and timed steps of every method, interleaved: each global batch trains under every
    method in turn (the order rotating per step), so a change in the machine's load (other
    processes on shared cores) falls on all methods alike. A record per method and timed step."""
    runs = {}
    for method, plan in plans.items():
        model, optimizer, loader = sharded(fresh_model(args, device, dtype), plan, cost, section, args, docs, lengths)
        runs[method] = (model, optimizer, loader, iter(loader))
    records = []
    methods = list(runs)
    bar = tqdm(
        total=(args.warmup + args.steps) * len(methods),
        desc="steps (every method in turn)",
        disable=dist.get_rank() != 0,
    )
    for n in range(args.warmup + args.steps):
        for method in methods[n % len(methods) :] + methods[: n % len(methods)]:
            model, optimizer, _, steps = runs[method]
            step = next(steps)  # planned and collated outside the timed region
            # on the rank's device: NCCL reduces device tensors only
            counts = torch.tensor(
                [sum(sum(d.seq_lens) for d in step.loaded), len(step.micro_batches)], dtype=torch.float64, device=device
            )
            synchronize(device)
            dist.barrier()
            t0 = time.perf_counter()
            loss = train_step(model, optimizer, step)
            synchronize(device)  # once per step: the step's kernels have run, not just been queued
            dist.barrier()
            ms = (time.perf_counter() - t0) * 1e3
            dist.all_reduce(counts)
            bar.update()
            if n >= args.warmup:
                records.append(
                    {
                        "method": method,
                        "step": n,
                        "measured_ms": ms,
                        "real_tokens": float(counts[0]),
                        "micro_batches": float(counts[1]) / dist.get_world_size(),
                        "loss": loss,
                        "loader_predicted_ms": step.predicted_ms,
                    }
                )
    bar.close()
    for _, _, loader, _ in runs.values():
        loader.close()
    del runs
    release(device)
    return records


def memory_run(
    plan: ShardPlan,
    cost: TableCostModel,
    section: dict,
    args: argparse.Namespace,
    docs,
    lengths,
    device: torch.device,
    dtype: str,
) -> dict:
    """Peak memory per rank of wrapping and ``MEMORY_STEPS`` steps, measured and predicted (lists over ranks)."""
    model = fresh_model(args, device, dtype)  # built outside: its unsharded weights are not the plan's
    with measure(device) as mem:
        model, optimizer, loader = sharded(model, plan, cost, section, args, docs, lengths)
        steps = []
        for step in loader:
            train_step(model, optimizer, step)
            step.micro_batches.clear()  # spent: what stays alive after the step is the model's states
            steps.append(step)
            if len(steps) == MEMORY_STEPS:
                break
    loader.close()
    mine = torch.tensor([mem.peak, predicted_peak_bytes(plan, cost, steps)], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    del model, optimizer, loader
    release(device)
    return {
        "measured_peak_mb": [float(g[0]) / MB for g in gathered],
        "predicted_peak_mb": [float(g[1]) / MB for g in gathered],
    }


def release(device: torch.device) -> None:
    """Free what a finished run left (its FSDP hooks hold reference cycles) before the next one is measured."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def summary_row(
    method: str,
    plan: ShardPlan | None,
    search_ms: float,
    timings: dict,
    reason: str,
    records: list[dict],
    memory: dict | None,
    cost: TableCostModel,
    args: argparse.Namespace,
) -> dict:
    row: dict[str, Any] = {
        "model": args.model,
        "layers": cost.num_layers,
        "gpus": dist.get_world_size(),
        "memory_budget_mb": args.budget_mb,
        "method": method,
        "fits": plan is not None,
        "global_tokens": args.global_tokens,
        "max_len": args.max_len,
    }
    if plan is None:
        return {**row, "reason": reason}
    secs = sum(r["measured_ms"] for r in records) / 1e3
    peak = max(memory["measured_peak_mb"])
    return {
        **row,
        "search_ms": search_ms,
        **timings,
        "sim_iter_ms": plan.step_ms,
        "compute_ms": plan.compute_ms,
        "comm_ms": sum(u.comm_ms for u in plan.units),
        "exposed_ms": plan.exposed_ms,
        "peak_mem_mb": plan.peak_bytes / MB,
        "shard_size": plan.shard_size,
        "choices": dict(sorted(Counter(u.choice.label for u in plan.units).items())),
        "steps": len(records),
        "micro_batches": sum(r["micro_batches"] for r in records) / len(records),
        "effective_tokens_per_s": sum(r["real_tokens"] for r in records) / secs,
        "measured_step_ms": secs * 1e3 / len(records),
        "final_loss": records[-1]["loss"],
        "measured_peak_mb": peak,
        "predicted_peak_mb": max(memory["predicted_peak_mb"]),
        "measured_peak_mb_per_rank": memory["measured_peak_mb"],
        "under_budget": peak < args.budget_mb,
    }


def add_speedups(rows: list[dict]) -> None:
    """Each fitting method's effective tokens/s over full_shard's, where full_shard ran."""
    base = next((r["effective_tokens_per_s"] for r in rows if r["method"] == "full_shard" and r["fits"]), None)
    for r in rows:
        if r["fits"] and base:
            r["speedup_vs_full_shard"] = r["effective_tokens_per_s"] / base


def report(rows: list[dict], args: argparse.Namespace, ranks_on: str, load: tuple[list[float], list[float]]) -> str:
    head = (
        "| method | fits | choices | micro-batches/step | effective tokens/s | vs full_shard | step ms measured "
        "| predicted | peak MB measured | predicted | budget |\n" + "|---" * 11 + "|\n"
    )
    body = ""
    for r in rows:
        if not r["fits"]:
            body += f"| {r['method']} | no | - | - | - | - | - | - | - | - | {r['memory_budget_mb']:,.0f} |\n"
            continue
        choices = ", ".join(f"{n} {label}" for label, n in r["choices"].items())
        vs = f"{r['speedup_vs_full_shard']:.2f}x" if "speedup_vs_full_shard" in r else "-"
        body += (
            f"| {r['method']} | yes | {choices} | {r['micro_batches']:.1f} | {r['effective_tokens_per_s']:,.0f} "
            f"| {vs} | {r['measured_step_ms']:,.0f} | {r['sim_iter_ms']:,.0f} | {r['measured_peak_mb']:,.1f} "
            f"| {r['predicted_peak_mb']:,.1f} | {r['memory_budget_mb']:,.0f} |\n"
        )
    missing = "".join(f"- {r['method']} does not fit: {r['reason']}\n" for r in rows if not r["fits"])
    text = (
        f"# Sharding plans trained: {args.model}, FSDP2, {dist.get_world_size()} {ranks_on}\n\n"
        f"Memory budget {args.budget_mb:,.0f} MB per rank (model states + activations; {args.budget_source}). Python standard library "
        f"source ({args.lengths}), sequences up to {args.max_len} tokens, {args.global_tokens:,} tokens per global "
        f"batch, {args.steps} timed steps per method after {args.warmup} warm-up, the methods taking turns on each "
        f"global batch. Effective tokens/s counts real "
        f"tokens. Predicted step: the plan's priced step ({cost_model_label(args.profile)}, overlap "
        f"{args.overlap if args.overlap is not None else 'default'}); peak: the largest over ranks of "
        f"{MEMORY_STEPS} steps (wrap included) in a separate run, measured against the plan's prediction for "
        f"those steps. Load average (1, 5, 15 min) at start {load[0]}, at end {load[1]}.\n\n"
        + head
        + body
        + ("\n" + missing if missing else "")
    )
    write_atomic(os.path.join(args.out, "report.md"), text)
    return text


def main() -> None:
    p = common_parser(
        __doc__,
        "out/shard-train",
        "profile JSON of the model on this machine (dynplugin profile "
        "--ranks 2); without it the analytic cost model prices the plans",
        steps_help="timed steps per method",
    )
    add_model_argument(p)
    p.add_argument(
        "--budget-mb",
        type=float,
        help="memory per rank the plans may use, model states and activations (default: the largest whole "
        "MB at which no_shard does not fit, its model states plus the longest sequence alone)",
    )
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument(
        "--overlap",
        type=float,
        help="sharding.overlap: share of the neighbouring module's compute that "
        "hides a collective (default: the config's)",
    )
    args = p.parse_args()
    methods = args.methods.split(",")
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"--methods: unknown {sorted(unknown)}; choose from {', '.join(METHODS)}")
    load_start = [round(x, 2) for x in os.getloadavg()]
    device = use_rank_device()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    dtype = profile_dtype(args.profile, device)
    os.makedirs(args.out, exist_ok=True)
    docs, lengths = tokenized_corpus(args.lengths, args.max_len, args.out)
    world = dist.get_world_size()
    # with room for anything (the budget only sets how much the planner may fill, not the prices)
    roomy = load_config({"dyn_plugin": plugin_section(args, dtype, world, ROOMY_MB)}).plugin
    model = fresh_model(args, device, dtype)  # the units, and the live shape for an analytic cost model
    cost, units = live_cost_model(roomy.cost_model, roomy.cluster, model_shape(model)), shard_units(model)
    del model
    args.budget_source = "--budget-mb"
    if args.budget_mb is None:
        args.budget_mb = tightest_budget_mb(units, cost, roomy, first_batch(lengths, args), world)
        args.budget_source = "the largest whole MB at which no_shard does not fit (the default)"
    section = plugin_section(args, dtype, world, args.budget_mb)
    plugin = load_config({"dyn_plugin": section}).plugin
    rows = []
    found = {method: find_plan(method, units, cost, plugin, args, lengths) for method in methods}
    plans = {method: plan for method, (plan, *_) in found.items() if plan is not None}
    records = timed_runs(plans, cost, section, args, docs, lengths, device, dtype)
    for method, (plan, search_ms, timings, reason) in found.items():
        memory = memory_run(plan, cost, section, args, docs, lengths, device, dtype) if plan is not None else None
        rows.append(
            summary_row(
                method,
                plan,
                search_ms,
                timings,
                reason,
                [r for r in records if r["method"] == method],
                memory,
                cost,
                args,
            )
        )
    if dist.get_rank() == 0:
        add_speedups(rows)
        text = report(rows, args, ranks_on(device, dtype), (load_start, [round(x, 2) for x in os.getloadavg()]))
        write_results(args.out, records, rows)
        print("\n" + text)
        print(f"report: {args.out}/report.md, per-step records: {args.out}/records.jsonl")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
