"""``dynplugin bench shard``: the sharding search (OSDP) against one strategy for every module.

For each model, cluster and memory budget: the searched plan (``osdp``) and FSDP's uniform
strategies (``full_shard``, ``shard_grad_op``, ``no_shard`` where it fits, and ``hybrid_shard``:
FULL_SHARD inside a node, replicated across nodes, with more than one node), each priced the same
way on the step the planner cuts for the memory its model states leave (plan/sharding/search.py), so
a method that keeps more gathered also gets fewer, smaller micro-batches or more recompute.
Records: search time (with its planning, pricing and knapsack parts), simulated step, peak by
the plan's own estimate and, for GPT-6.7B, by the measured tables (``table_peak_bytes``: the
step the loader plans for the plan, its layers' activations read off the A100 tables without any
fit), and whether each is within the budget.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections import Counter
from typing import Iterable, Sequence

from ..cli_args import RANK_COUNTS, SEED, STEPS, TOKENS, choices, count, input_file, number, numbers, output_dir
from ..config import DynPluginConfig
from ..cost.from_config import build_cost_model
from ..cost.table import TableCostModel
from ..cost.table_memory import MeasuredLayerMemory
from ..lengths.io import cap_lengths, load_lengths
from ..plan.methods.planner import plan_step
from ..plan.sharding.search import BASELINES, choice_columns, search_sharding, uniform_plan
from ..plan.sharding.shard_plan import MB, Choice, ShardPlan, ShardUnit
from ..plan.steps.spec import planner_spec
from ..runtime.sampler import global_batches
from .launch import launch_comparison
from .memory import measured_tables, table_micro_batch

logger = logging.getLogger(__name__)

# hybrid_shard: FULL_SHARD inside each node, replicated across nodes (FSDP's HYBRID_SHARD), where there are nodes;
# best_uniform: the fastest plan with one choice for every module that fits (what a user tunes: FSDP2's
# reshard_after_forward True / False / a node's ranks, reshard_after_backward False (keep), replicate, over
# the world or, hybrid, a node), its choice and shard size recorded
METHODS = ("osdp",) + tuple(BASELINES) + ("hybrid_shard", "best_uniform")
# The two models: the A100-measured GPT-6.7B (its profile's fp16 layers) and a 48-layer GPT
# (GPT-2 XL's shape) priced by the analytic model at A100 figures, for the search at depth.
SETUPS = {
    "gpt-6.7b": {"cost_model": {"kind": "profile", "profile": "a100-gpt-6.7b", "dtype": "fp16"}},
    "gpt-48l": {
        "cost_model": {
            "kind": "analytic",
            "dtype": "fp16",
            "model": {
                "hidden_size": 1600,
                "num_layers": 48,
                "num_heads": 25,
                "ffn_hidden_size": 6400,
                "vocab_size": 50304,
                "gated_mlp": False,
            },
        }
    },
}
# the measured tables each setup's layers can be priced by independently (the analytic model has none)
A100 = {"name": "A100-40GB", "memory_mb": 40000, "memory_fraction": 1.0, "peak_tflops": 312, "achieved_fraction": 0.5}
# GPT-2 XL's shape with Megatron's padded vocabulary and an untied head (the head can then be split)
GPT_48L = dict(
    model_type="gpt2",
    n_embd=1600,
    n_layer=48,
    n_head=25,
    n_inner=6400,
    vocab_size=50304,
    n_positions=8192,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
)
HELP = (
    "the sharding search (osdp) against full_shard, shard_grad_op and no_shard: "
    "search time, simulated step and peak memory on A100 costs"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        type=choices(tuple(SETUPS)),
        default="gpt-6.7b,gpt-48l",
        help="gpt-6.7b (A100-measured layers), gpt-48l (GPT-2 XL's shape, analytic A100 costs)",
    )
    parser.add_argument("--gpus", type=RANK_COUNTS, default="8,16", help="ranks (8 per node)")
    parser.add_argument("--budgets-mb", type=numbers(), default="24000,30000,36000", help="memory budgets per rank")
    parser.add_argument("--tokens-per-gpu", type=TOKENS, default=16384, help="global batch = this x gpus tokens")
    parser.add_argument("--max-len", type=TOKENS, help="sequences are capped at this (default 8192; 4096 with --train)")
    parser.add_argument("--lengths", default="code")
    parser.add_argument("--seed", type=SEED, default=0)
    parser.add_argument(
        "--train",
        action="store_true",
        help="instead, train tiny Llama with FSDP2 on local CPU ranks (a GPU each where there are GPUs) "
        "under --budget-mb, every method's plan side by side: measured effective tokens/s and peak "
        "memory (dyn_plugin/bench/train_fsdp.py)",
    )
    parser.add_argument(
        "--budget-mb",
        type=number(),
        help="with --train: memory per rank (model states + activations) "
        "the plans are searched for and trained under (default: the "
        "largest whole MB at which no_shard does not fit)",
    )
    parser.add_argument(
        "--profile",
        type=input_file,
        help="with --train: tiny-llama profile of this machine (dynplugin profile --ranks 2); "
        "without it the analytic cost model prices the plans",
    )
    parser.add_argument("--out", type=output_dir, default="out/bench-shard-train", help="with --train: report folder")
    parser.add_argument("--steps", type=STEPS, default=4, help="with --train: timed steps per method")
    parser.add_argument("--ranks", type=count(1, 1024), default=2, help="with --train: local ranks")
    parser.add_argument("--global-tokens", type=TOKENS, default=16384, help="with --train: tokens per global batch")
    parser.add_argument("--overlap", type=number(), help="with --train: sharding.overlap (default: the config's)")


def run(args: argparse.Namespace) -> Iterable[dict]:
    """The simulated comparison of both models, or with ``--train`` the plans trained side by side
    (bench/train_fsdp.py on local ranks)."""
    if args.train:
        return train_plans(args)
    from ..models.shard_units import config_units

    args.max_len = args.max_len or 8192
    return bench_shard(
        args, {"gpt-6.7b": config_units(example_config("gpt-6.7b.json"))[1], "gpt-48l": config_units(GPT_48L)[1]}
    )


def train_plans(args: argparse.Namespace) -> list[dict]:
    """Launch the sharding plans side by side on local ranks (torchrun); their summary rows (launch.py)."""
    extra = [
        "--max-len",
        str(args.max_len or 4096),
        "--global-tokens",
        str(args.global_tokens),
        "--lengths",
        args.lengths,
        "--seed",
        str(args.seed),
    ]
    for flag, value in (("--budget-mb", args.budget_mb), ("--overlap", args.overlap)):
        extra += [flag, str(value)] if value is not None else []
    return launch_comparison("dyn_plugin.bench.train_fsdp", "shard-train", args, extra)


def example_config(name: str) -> str:
    """A model config in the checkout's examples/, found from this file (not the working directory);
    a refusal where the package was installed without them."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(repo, "examples", name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: bench shard needs a source checkout of dyn-plugin (its examples/)")
    return path


def plugin_config(setup: str, gpus: int, budget_mb: float, tokens_per_gpu: int, max_len: int) -> DynPluginConfig:
    """A DGX-like cluster: 8 A100s per node at 100 GB/s, 12.5 GB/s per device between nodes."""
    nodes = max(1, gpus // 8)
    return DynPluginConfig.model_validate(
        {
            **SETUPS[setup],
            "microbatching": {"global_tokens": tokens_per_gpu * gpus, "max_seq_len": max_len, "truncate": True},
            "sharding": {"enabled": True, "memory_budget_mb": budget_mb},
            "cluster": {"devices_per_node": gpus // nodes, "num_nodes": nodes, "device": A100},
        }
    )


def bench_shard(args: argparse.Namespace, units: dict[str, Sequence[ShardUnit]]) -> list[dict]:
    """One record per (model, gpus, budget, method); ``units`` per model name (models/shard_units.py)."""
    records = []
    lengths = cap_lengths(load_lengths(args.lengths), args.max_len, True)
    for setup in args.models:
        for gpus in args.gpus:
            for budget in args.budgets_mb:
                config = plugin_config(setup, gpus, budget, args.tokens_per_gpu, args.max_len)
                ids = global_batches(lengths, config.microbatching.global_tokens, 1, args.seed)[0]
                batch = [int(lengths[i]) for i in ids]
                base = {
                    "benchmark": "shard",
                    "model": setup,
                    "gpus": gpus,
                    "memory_budget_mb": budget,
                    "lengths": args.lengths,
                    "global_tokens": sum(batch),
                }
                records += compare_methods(units[setup], config, batch, base, int(lengths.max()))
    return records


def table_peak_bytes(
    plan: ShardPlan, batch: list[int], cost: TableCostModel, config: DynPluginConfig, tables: MeasuredLayerMemory
) -> float:
    """The plan's peak per rank with activations priced by the measured tables: its model states
    plus the worst micro-batch of the step the loader plans for it (``planning_state_bytes``, as
    ``DynLoader(state_bytes=...)`` does; one micro-batch in flight on one stage)."""
    spec = planner_spec(cost, config, dp=plan.world, zero_stage=3, state_bytes=plan.planning_state_bytes)
    step = plan_step(batch, spec)
    worst = max(table_micro_batch(mb, spec, tables)[0].peak_bytes[0] for r in step.replicas for mb in r.micro_batches)
    return plan.state_bytes + worst


def best_uniform(
    units: Sequence[ShardUnit],
    cost: TableCostModel,
    config: DynPluginConfig,
    batch: list[int],
    model: str,
    longest: int,
) -> ShardPlan:
    """The fastest uniform plan that fits: every choice but split (a per-module rewrite, not a
    knob) for every module, sharded over the world and, with more than one node, over a node."""
    gpus = config.cluster.world_size
    sizes = [gpus] + ([config.cluster.devices_per_node] if config.cluster.num_nodes > 1 else [])
    best = None
    for n in sizes:
        for choice in choice_columns(config, "fsdp2", n):
            if choice.kind == "split":
                continue
            try:
                plan = uniform_plan(
                    units, cost, config, choice, world=gpus, lengths=batch, model=model, shard_size=n, longest=longest
                )
            except ValueError:  # does not fit
                continue
            if best is None or plan.step_ms < best.step_ms:
                best = plan
    if best is None:
        raise ValueError("no uniform plan fits the budget")
    return best


def compare_methods(
    units: Sequence[ShardUnit], config: DynPluginConfig, batch: list[int], base: dict, longest: int
) -> list[dict]:
    """Every method on one model, cluster, budget and global batch, side by side; each leaves room
    for the ``longest`` sequence of the run alone."""
    cost = build_cost_model(config.cost_model, config.cluster)
    tables = measured_tables(base["model"])
    budget_mb = config.sharding.memory_budget_mb
    gpus, nodes = config.cluster.world_size, config.cluster.num_nodes
    plans: dict[str, ShardPlan] = {}
    rows = []
    for method in METHODS if nodes > 1 else tuple(m for m in METHODS if m != "hybrid_shard"):
        timings: dict = {}
        t0 = time.perf_counter()
        try:
            if method == "best_uniform":
                plan = best_uniform(units, cost, config, batch, base["model"], longest)
            elif method == "osdp":
                plan = search_sharding(
                    units,
                    cost,
                    config,
                    world=gpus,
                    lengths=batch,
                    model=base["model"],
                    timings=timings,
                    longest=longest,
                )
            else:
                plan = uniform_plan(
                    units,
                    cost,
                    config,
                    BASELINES.get(method, Choice("full")),
                    world=gpus,
                    lengths=batch,
                    model=base["model"],
                    shard_size=gpus // nodes if method == "hybrid_shard" else None,
                    longest=longest,
                )
        except ValueError as exc:  # does not fit the budget
            logger.info(
                "%s, %d GPUs, %.0f MB: %s does not fit: %s", base["model"], gpus, base["memory_budget_mb"], method, exc
            )
            rows.append({**base, "layers": cost.num_layers, "method": method, "fits": False})
            continue
        search_ms = (time.perf_counter() - t0) * 1e3
        plans[method] = plan
        table_mb = table_peak_bytes(plan, batch, cost, config, tables) / MB if tables else None
        rows.append(
            {
                **base,
                "layers": cost.num_layers,
                "method": method,
                "fits": True,
                "search_ms": search_ms,
                **timings,
                "sim_iter_ms": plan.step_ms,
                "exposed_ms": plan.exposed_ms,
                "peak_mem_mb": plan.peak_bytes / MB,
                "within_budget": plan.peak_bytes / MB <= budget_mb,
                # null for setups without measured tables (the analytic 48-layer GPT)
                "peak_mem_mb_tables": table_mb,
                "within_budget_tables": None if table_mb is None else table_mb <= budget_mb,
                "micro_batches": plan.micro_batches,
                "shard_size": plan.shard_size,
                "choices": dict(sorted(Counter(u.choice.label for u in plan.units).items())),
            }
        )
    for r in rows:
        for other in ("full_shard", "hybrid_shard", "best_uniform"):
            if other in plans and r["fits"]:
                r[f"speedup_vs_{other}"] = plans[other].step_ms / r["sim_iter_ms"]
    return rows
