"""``dynplugin bench planner``: the planner against the baselines on measured A100 costs.

A GPT-6.7B-class model (32 layers split over the pipeline stages, the A100 tables on an
A100-80GB with a 72000 MB limit, ZeRO-1: at 36000 MB, the 40GB card's, an 8192-token sequence
fits no stage of 4 even with full recompute), global batches drawn from the bundled length distributions.
Sequences longer than the tables measured (8192) are truncated to it, as a trainer with
max_seq_len 8192 would. The plugin plans with pyramid checkpointing (the config's default);
``dynapipe_all_or_nothing`` is the same planner with every micro-batch recomputing all of its
layers or none, and its ``pyramid_speedup`` says how much faster the pyramid plans are;
``dynapipe_zero_bubble`` the same planner with backwards split where that fills the pipeline
(``pipeline.schedule: zero_bubble``); its ``token_slices_what_if`` simulates those plans with each
replica's longest sequence cut into token slices (``plan/steps/token_slices.py``: no host runs
them yet).
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import replace
from typing import Iterable, Iterator

import numpy as np

from .. import cli_args  # as a module: the planner's loops have a ``count`` of their own
from ..config import DynPluginConfig
from ..cost.bundled import load_bundled
from ..cost.profile import cost_model_from_profile
from ..lengths.corpus import DISTRIBUTIONS
from ..lengths.io import load_lengths
from ..plan.methods.baselines import BASELINES, plan_baseline
from ..plan.methods.planner import plan_step
from ..plan.steps.bounds import critical_path_ms, gap_terms, ideal_ms
from ..plan.steps.spec import planner_spec
from ..plan.steps.token_slices import sliced_step_ms
from ..runtime.sampler import global_batches
from . import planner_pairs
from .plan_records import plan_summary, timed_plans

MAX_LEN = 8192
HELP = (
    "planning time and simulated step time against the baselines, "
    "A100 GPT-6.7B costs, bundled length distributions (--model t5-11b: A100 T5 11B costs, the bundled "
    "pair distribution 'tasks', the pair baselines)"
)
# the models and their default global tokens and pp x dp grids
DEFAULTS = {
    "gpt-6.7b": ("16384,65536,262144", "1x1,4x2,8x8"),
    "t5-11b": (planner_pairs.GLOBAL_TOKENS, planner_pairs.PARALLEL),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        choices=DEFAULTS,
        default="gpt-6.7b",
        help="gpt-6.7b (dyn_plugin/bench/planner.py) or t5-11b: (input, target) pairs on encoder then decoder "
        "stages (dyn_plugin/bench/planner_pairs.py; --distributions, --python-batches and --no-pyramid do not apply)",
    )
    parser.add_argument("--distributions", type=cli_args.choices(tuple(DISTRIBUTIONS)), default="code,prose,mixture")
    parser.add_argument(
        "--global-tokens",
        type=cli_args.TOKEN_COUNTS,
        help="default 16384,65536,262144 (gpt-6.7b), 65536 (t5-11b: input and target tokens)",
    )
    parser.add_argument(
        "--parallel", type=cli_args.grids, help="pp x dp configurations; default 1x1,4x2,8x8 (gpt-6.7b), 4x2 (t5-11b)"
    )
    parser.add_argument("--batches", type=cli_args.STEPS, default=10, help="global batches per configuration")
    parser.add_argument(
        "--python-batches",
        type=cli_args.count(0),
        default=2,
        help="of those, how many also go through the (slow) pure-Python planner",
    )
    parser.add_argument("--seed", type=cli_args.SEED, default=0)
    parser.add_argument(
        "--no-pyramid",
        action="store_true",
        help="plan without pyramid checkpointing (every micro-batch recomputes all of its layers or "
        "none); by default the all-or-nothing plans are also run as dynapipe_all_or_nothing",
    )


def run(args: argparse.Namespace) -> Iterable[dict]:
    """The model's records, its defaults filled in where the flags were left out."""
    tokens, grid = DEFAULTS[args.model]
    args.global_tokens = cli_args.TOKEN_COUNTS(tokens) if args.global_tokens is None else args.global_tokens
    args.parallel = cli_args.grids(grid) if args.parallel is None else args.parallel
    if args.model == "t5-11b":
        return planner_pairs.bench_planner_pairs(args)
    return bench_planner(args)


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
    split = replace(spec, schedule="zero_bubble")
    if spec.pp > 1:  # backwards split where that fills the pipeline
        runs.append(("dynapipe_zero_bubble", "cpp", lambda b: plan_step(b, split, native=True), len(batches)))
    runs += [(name, "python", lambda b, n=name: plan_baseline(n, b, spec, MAX_LEN), len(batches)) for name in BASELINES]
    planned = None  # the plugin's step times (C++ DP), which the all-or-nothing row compares with
    for method, impl, fn, count in runs:
        if count == 0:
            continue
        rec = {**base, "method": method, "impl": impl, "batches": count}
        try:
            plans, times = timed_plans(fn, batches[:count])
        except ValueError as exc:  # infeasible for this configuration (e.g. fewer sequences than replicas)
            yield {**rec, "error": str(exc)}
            continue
        iters = [p.iteration_ms for p in plans]
        rec.update(
            plan_summary(plans, times),
            ideal_ms=float(np.mean(ideal[:count])),
            vs_ideal=float(np.mean([i / d for i, d in zip(iters, ideal)])),
            lower_bound_ms=float(np.mean(bound[:count])),
            vs_lower_bound=float(np.mean([i / d for i, d in zip(iters, bound)])),
            layout=plans[0].layout,
        )
        if impl == "cpp":  # ms of the step beyond ideal_ms, term by term (plan/steps/bounds.py gap_terms)
            gaps = [gap_terms(p, b, spec) for p, b in zip(plans, batches)]
            rec["gap_ms"] = {k: float(np.mean([g[k] for g in gaps])) for k in gaps[0]}
        if method == "dynapipe_zero_bubble":  # what-if: each replica's longest sequence cut into token slices
            sliced = [sliced_step_ms(p, split) for p in plans]
            rec["token_slices_what_if"] = {
                "sim_iter_ms": float(np.mean([ms for ms, _ in sliced])),
                "vs_ideal": float(np.mean([ms / d for (ms, _), d in zip(sliced, ideal)])),
                "speedup": float(np.mean([i / ms for (ms, _), i in zip(sliced, iters)])),
                "slices": dict(Counter(k for _, ks in sliced for k in ks)),
            }
        if (method, impl) == ("dynapipe", "cpp"):
            planned = iters
        elif method == "dynapipe_all_or_nothing" and planned is not None:
            rec["pyramid_speedup"] = float(np.mean([a / p for a, p in zip(iters, planned)]))
        yield rec
