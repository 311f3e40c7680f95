"""``dynplugin bench planner``: the planner against the baselines on measured A100 costs.

A GPT-6.7B-class model (32 layers split over the pipeline stages, the A100 tables on an
A100-80GB with a 72000 MB limit, ZeRO-1: at 36000 MB, the 40GB card's, an 8192-token sequence
fits no stage of 4 even with full recompute), global batches drawn from the bundled length distributions.
Sequences longer than the tables measured (8192) are truncated to it, as a trainer with
max_seq_len 8192 would. The plugin plans with pyramid checkpointing (the config's default);
``dynapipe_all_or_nothing`` is the same planner with every micro-batch recomputing all of its
layers or none, and its ``pyramid_speedup`` says how much faster the pyramid plans are.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Iterator

import numpy as np

from ..config import DynPluginConfig
from ..cost.bundled import load_bundled
from ..cost.profile import cost_model_from_profile
from ..lengths.io import load_lengths
from ..plan.methods.baselines import BASELINES, plan_baseline
from ..plan.methods.planner import plan_step
from ..plan.steps.bounds import critical_path_ms, ideal_ms
from ..plan.steps.spec import planner_spec
from ..runtime.sampler import global_batches

MAX_LEN = 8192


def _ms(fn) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def bench_planner(args: argparse.Namespace) -> Iterator[dict]:
    cost = cost_model_from_profile(load_bundled("a100-gpt-6.7b"))
    for dist in args.distributions:
        lengths = np.minimum(load_lengths(dist), MAX_LEN)
        for tokens in args.global_tokens:
            batches = [[int(lengths[i]) for i in b] for b in global_batches(lengths, tokens, args.batches, args.seed)]
            for pp, dp in args.parallel:
                cfg = DynPluginConfig.model_validate(
                    {
                        "pipeline": {"stages": pp},
                        "cluster": {"devices_per_node": 8, "device": {"memory_mb": 72000, "memory_fraction": 1.0}},
                        "sequence_parallel": {"pyramid": not args.no_pyramid},
                    }
                )
                base = {"distribution": dist, "global_tokens": tokens, "pp": pp, "dp": dp}
                try:
                    spec = planner_spec(cost, cfg, dp=dp, zero_stage=1, seed=args.seed)
                except ValueError as exc:  # e.g. the model states alone overflow a device
                    yield {**base, "method": "all", "error": str(exc)}
                    continue
                yield from _bench_config(base, batches, spec, args.python_batches)


def _bench_config(base: dict, batches: list[list[int]], spec, python_batches: int) -> Iterator[dict]:
    ideal = [ideal_ms(b, spec) for b in batches]
    # max(ideal, longest sequence's critical path): what no plan can beat
    bound = [max(i, critical_path_ms(b, spec)) for i, b in zip(ideal, batches)]
    runs = [
        ("dynapipe", "cpp", lambda b: plan_step(b, spec, native=True), len(batches)),
        ("dynapipe", "python", lambda b: plan_step(b, spec, native=False), python_batches),
    ]
    if spec.pyramid:
        whole = replace(spec, pyramid=False)
        runs.append(("dynapipe_all_or_nothing", "cpp", lambda b: plan_step(b, whole, native=True), len(batches)))
    runs += [(name, "python", lambda b, n=name: plan_baseline(n, b, spec, MAX_LEN), len(batches)) for name in BASELINES]
    planned = None  # the plugin's step times (C++ DP), which the all-or-nothing row compares with
    for method, impl, fn, count in runs:
        if count == 0:
            continue
        rec = {**base, "method": method, "impl": impl, "batches": count}
        try:
            results = [_ms(lambda b=b: fn(b)) for b in batches[:count]]
        except ValueError as exc:  # infeasible for this configuration (e.g. fewer sequences than replicas)
            yield {**rec, "error": str(exc)}
            continue
        plans, times = zip(*results)
        iters = [p.iteration_ms for p in plans]
        rec.update(
            plan_ms_p50=float(np.percentile(times, 50)),
            plan_ms_p99=float(np.percentile(times, 99)),
            sim_iter_ms=float(np.mean(iters)),
            ideal_ms=float(np.mean(ideal[:count])),
            vs_ideal=float(np.mean([i / d for i, d in zip(iters, ideal)])),
            lower_bound_ms=float(np.mean(bound[:count])),
            vs_lower_bound=float(np.mean([i / d for i, d in zip(iters, bound)])),
            padding_fraction=float(np.mean([p.padding_fraction for p in plans])),
            peak_mem_bytes=float(max(p.peak_bytes for p in plans)),
            bubble=float(np.mean([p.bubble_fraction for p in plans])),
            micro_batches=float(np.mean([len(p.micro_batches) for p in plans])),
            layout=plans[0].layout,
        )
        if (method, impl) == ("dynapipe", "cpp"):
            planned = iters
        elif method == "dynapipe_all_or_nothing" and planned is not None:
            rec["pyramid_speedup"] = float(np.mean([a / p for a, p in zip(iters, planned)]))
        yield rec
