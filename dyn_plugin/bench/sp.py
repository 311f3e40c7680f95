"""``dynplugin bench sp``: dynamic sequence parallelism against fixed and bucketed sizes, simulated.

A GPT-6.7B-class model on the measured A100 tables (an A100-80GB: 72000 MB per device, less the
allocator's margin, ZeRO-1, 8 devices per node) with the attention collectives priced from the link bandwidths; global batches drawn from
the bundled length distributions, sequences capped at ``max_len``. The tables were measured up
to 8192 tokens, so longer sequences are priced by extrapolation; every record counts the
micro-batches that were (``extrapolated``). Methods (plan/methods/baselines.py for the baselines):
``dynamic_sp`` (the plugin), ``dynamic_sp_whole_stage`` (the same without pyramid
checkpointing), ``dynapipe`` (no sequence parallelism; infeasible where a sequence fits no
device), ``fixed_sp``, ``megatron_hybrid_cp``, ``dcp_bucket``.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import replace
from typing import Iterator

import numpy as np

from ..cli_args import RANK_COUNTS, SEED, STEPS, TOKEN_COUNTS, choices, powers_of_two
from ..config import DynPluginConfig
from ..cost.bundled import load_bundled
from ..cost.profile import cost_model_from_profile
from ..cost.table_memory import MeasuredLayerMemory
from ..lengths.corpus import DISTRIBUTIONS
from ..lengths.io import load_lengths
from ..plan.methods.baselines import SP_BASELINES, plan_baseline
from ..plan.methods.planner import plan_step
from ..plan.steps.bounds import critical_path_ms, gap_terms, ideal_ms
from ..plan.steps.spec import planner_spec
from ..runtime.sampler import global_batches
from .memory import measured_tables, memory_record
from .plan_records import schedule_counts

logger = logging.getLogger(__name__)

HEADS = 32  # GPT-6.7B: 32 heads of 128
# An A100-80GB at the share of the card DynaPipe's 36000 MB left of a 40 GB one: at 36000 MB the
# measured per-length activations leave no room for an 8192-token sequence on a pipeline stage
MEMORY_MB = 72000
HELP = (
    "dynamic sequence parallelism vs fixed sizes, Megatron's hybrid CP and DCP's "
    "buckets: simulated step on A100 GPT-6.7B costs with priced attention collectives"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--distributions", type=choices(tuple(DISTRIBUTIONS)), default="code,prose,mixture")
    parser.add_argument("--global-tokens", type=TOKEN_COUNTS, default="65536,262144")
    parser.add_argument("--gpus", type=RANK_COUNTS, default="8,32")
    parser.add_argument(
        "--pp", type=RANK_COUNTS, default="4,1", help="pipeline stages, comma-separated (columns = gpus / pp)"
    )
    parser.add_argument(
        "--max-len", type=TOKEN_COUNTS, default="8192,32768", help="sequences are capped at each of these"
    )
    parser.add_argument(
        "--sizes",
        type=powers_of_two(),
        default="1,2,4,8,16,32",
        help="sequence-parallel group sizes allowed (those up to the column count apply)",
    )
    parser.add_argument("--batches", type=STEPS, default=4, help="global batches per configuration")
    parser.add_argument("--seed", type=SEED, default=0)


def run(args: argparse.Namespace) -> Iterator[dict]:
    cost = replace(
        cost_model_from_profile(load_bundled("a100-gpt-6.7b")),
        allow_extrapolation=True,
        num_heads=HEADS,
        num_kv_heads=HEADS,
    )
    tables = measured_tables("gpt-6.7b")
    for dist in args.distributions:
        raw = load_lengths(dist)
        for max_len in args.max_len:
            lengths = np.minimum(raw, max_len)
            for tokens in args.global_tokens:
                batches = [
                    [int(lengths[i]) for i in b] for b in global_batches(lengths, tokens, args.batches, args.seed)
                ]
                for gpus in args.gpus:
                    for pp in args.pp:
                        base = {
                            "distribution": dist,
                            "global_tokens": tokens,
                            "gpus": gpus,
                            "pp": pp,
                            "max_len": max_len,
                        }
                        yield from _bench_config(base, batches, cost, gpus // pp, args, tables)


def _spec(cost, dp: int, pp: int, args: argparse.Namespace, max_len: int, *, sp: bool, pyramid: bool = True):
    cfg = DynPluginConfig.model_validate(
        {
            "pipeline": {"stages": pp},
            "microbatching": {"max_seq_len": max_len},
            "sequence_parallel": {"enabled": sp, "sizes": list(args.sizes), "pyramid": pyramid},
            "cluster": {"devices_per_node": 8, "device": {"memory_mb": MEMORY_MB, "memory_fraction": 1.0}},
        }
    )
    return planner_spec(cost, cfg, dp=dp, zero_stage=1, seed=args.seed)


def _bench_config(
    base: dict, batches: list[list[int]], cost, dp: int, args: argparse.Namespace, tables: MeasuredLayerMemory
) -> Iterator[dict]:
    max_len, pp = base["max_len"], base["pp"]
    try:
        sp_spec = _spec(cost, dp, pp, args, max_len, sp=True)
    except ValueError as exc:  # e.g. the model states alone overflow a device at this pipeline depth
        yield {**base, "method": "all", "error": str(exc)}
        return
    methods = {
        "dynamic_sp": lambda b: plan_step(b, sp_spec),
        # the same with backwards split where that fills the pipeline
        **(
            {"dynamic_sp_zero_bubble": lambda b, s=replace(sp_spec, schedule="zero_bubble"): plan_step(b, s)}
            if pp > 1
            else {}
        ),
        "dynamic_sp_whole_stage": lambda b, s=_spec(cost, dp, pp, args, max_len, sp=True, pyramid=False): plan_step(
            b, s
        ),
        "dynapipe": lambda b, s=_spec(cost, dp, pp, args, max_len, sp=False): plan_step(b, s),
        **{name: (lambda b, n=name: plan_baseline(n, b, sp_spec, max_len)) for name in SP_BASELINES},
    }
    ideal = [ideal_ms(b, sp_spec) for b in batches]
    critical = [critical_path_ms(b, sp_spec) for b in batches]
    for method, fn in methods.items():
        rec = {**base, "method": method, "batches": len(batches)}
        plans, times = [], []
        try:
            for b in batches:
                t0 = time.perf_counter()
                plans.append(fn(b))
                times.append((time.perf_counter() - t0) * 1e3)
        except ValueError as exc:  # infeasible here, e.g. a sequence no group of this method can hold
            yield {**rec, "error": str(exc)}
            continue
        iters = [p.iteration_ms for p in plans]
        sizes = [k for p in plans for k in p.group_sizes]
        gaps = [gap_terms(p, b, sp_spec) for p, b in zip(plans, batches)]
        # every plan's peak per GPU, by the cost model and by the measured tables, against the
        # memory plans may fill (the device's less the allocator's margin)
        plannable = sp_spec.memory[0].budget + sp_spec.memory[0].states
        memory = memory_record(plans, {(1, pp, k): sp_spec for k in sp_spec.sp_sizes}, plannable, tables=tables)
        yield {
            **rec,
            "plan_ms_p50": float(np.percentile(times, 50)),
            "sim_iter_ms": float(np.mean(iters)),
            "ideal_ms": float(np.mean(ideal)),
            # the longest sequence's own pass through the pipeline: no plan of this batch is faster
            "critical_path_ms": float(np.mean(critical)),
            "vs_ideal": float(np.mean([i / d for i, d in zip(iters, ideal)])),
            "group_sizes": {str(k): sizes.count(k) / len(plans) for k in sorted(set(sizes))},
            "micro_batches": float(np.mean([len(p.micro_batches) for p in plans])),
            "extrapolated": int(sum(p.extrapolated for p in plans)),
            "bubble": float(np.mean([p.bubble_fraction for p in plans])),
            "schedules": schedule_counts(plans),
            # ms of the step beyond ideal_ms, term by term (plan/steps/bounds.py gap_terms)
            "gap_ms": {k: float(np.mean([g[k] for g in gaps])) for k in gaps[0]},
            **memory,
        }
