"""``dynplugin bench shard``: the sharding search (OSDP) against one strategy for every module.

For each model, cluster and memory budget: the searched plan (``osdp``) and FSDP's uniform
strategies (``full_shard``, ``shard_grad_op``, ``no_shard`` where it fits, and ``hybrid_shard``:
FULL_SHARD inside a node, replicated across nodes, with more than one node), each priced the same
way on the step the planner cuts for the memory its model states leave (plan/sharding.py), so
a method that keeps more gathered also gets fewer, smaller micro-batches or more recompute.
Records: search time (with its planning, pricing and knapsack parts), simulated step, peak.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import Counter
from typing import Sequence

from ..config import DynPluginConfig
from ..cost.from_config import build_cost_model
from ..lengths.io import cap_lengths, load_lengths
from ..plan.shard_plan import MB, Choice, ShardPlan, ShardUnit
from ..plan.sharding import BASELINES, search_sharding, uniform_plan
from ..runtime.sampler import global_batches

logger = logging.getLogger(__name__)

# hybrid_shard: FULL_SHARD inside each node, replicated across nodes (FSDP's HYBRID_SHARD), where there are nodes
METHODS = ("osdp",) + tuple(BASELINES) + ("hybrid_shard",)
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
A100 = {"name": "A100-40GB", "memory_mb": 40000, "memory_fraction": 1.0, "peak_tflops": 312, "achieved_fraction": 0.5}


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


def compare_methods(
    units: Sequence[ShardUnit], config: DynPluginConfig, batch: list[int], base: dict, longest: int
) -> list[dict]:
    """Every method on one model, cluster, budget and global batch, side by side; each leaves room
    for the ``longest`` sequence of the run alone."""
    cost = build_cost_model(config.cost_model, config.cluster)
    gpus, nodes = config.cluster.world_size, config.cluster.num_nodes
    plans: dict[str, ShardPlan] = {}
    rows = []
    for method in METHODS if nodes > 1 else METHODS[:-1]:
        timings: dict = {}
        t0 = time.perf_counter()
        try:
            if method == "osdp":
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
        plans[method] = plan
        rows.append(
            {
                **base,
                "layers": cost.num_layers,
                "method": method,
                "fits": True,
                "search_ms": (time.perf_counter() - t0) * 1e3,
                **timings,
                "sim_iter_ms": plan.step_ms,
                "exposed_ms": plan.exposed_ms,
                "peak_mem_mb": plan.peak_bytes / MB,
                "micro_batches": plan.micro_batches,
                "shard_size": plan.shard_size,
                "choices": dict(sorted(Counter(u.choice.label for u in plan.units).items())),
            }
        )
    for r in rows:
        for other in ("full_shard", "hybrid_shard"):
            if other in plans and r["fits"]:
                r[f"speedup_vs_{other}"] = plans[other].step_ms / r["sim_iter_ms"]
    return rows
