"""``dynplugin bench planner --model t5-11b``: the pair planner against the pair baselines on the
measured A100 T5 11B tables, global batches of the bundled pair distribution "tasks".

T5 11B (24 encoder and 24 decoder layers) on the same cluster as the GPT records (A100-80GB at
72000 MB, 8 devices a node, ZeRO-1), tensor parallel 1; inputs and targets truncated to the
tables' longest (4096 each side at tp 1), as a trainer with those maxima would. Padding and
packing use the maxima of the truncated distribution per side (the sequence lengths a user sets).
Every method is priced by the same cost model and simulated the same way (plan/pair_*.py), at
every split of the pipeline into encoder and decoder stages. ``dynapipe_zero_bubble``: the same
planner with backwards split where that fills the pipeline (``pipeline.schedule: zero_bubble``).
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import replace
from typing import Iterator

import numpy as np

from ..config import DynPluginConfig
from ..cost.bundled import MEASURED_DIR
from ..cost.encoder_decoder import import_t5_tables
from ..lengths.pairs import load_pairs
from ..plan.methods.pair_baselines import PAIR_BASELINES
from ..plan.steps.pair_planner import plan_pairs
from ..plan.steps.pair_spec import pair_planner_spec
from ..runtime.sampler import global_batches
from .plan_records import plan_summary, timed_plans

MAX_LEN = 4096  # the longest input and target the tp 1 tables measured
DISTRIBUTION = "tasks"
TP = 1
# ``bench planner --model t5-11b``'s defaults: global tokens (input and target) and pp x dp grid
GLOBAL_TOKENS, PARALLEL = "65536", "4x2"


def bench_planner_pairs(args: argparse.Namespace) -> Iterator[dict]:
    cost = import_t5_tables(MEASURED_DIR / "a100-t5-11b.json")
    pairs = np.minimum(load_pairs(DISTRIBUTION), MAX_LEN)
    max_input, max_target = (int(x) for x in pairs.max(axis=0))
    for tokens in args.global_tokens:
        batches = [pairs[b] for b in global_batches(pairs, tokens, args.batches, args.seed)]
        for pp, dp in args.parallel:
            cfg = DynPluginConfig.model_validate(
                {
                    "pipeline": {"stages": pp},
                    "cluster": {"devices_per_node": 8, "device": {"memory_mb": 72000, "memory_fraction": 1.0}},
                }
            )
            base = {
                "model": "t5-11b",
                "distribution": DISTRIBUTION,
                "global_tokens": tokens,
                "pp": pp,
                "dp": dp,
                "tp": TP,
            }
            # every split of encoder and decoder stages: the split is fixed when the model is built,
            # and each method is best at its own (BENCHMARKS compares each at its best)
            for split in range(1, pp) if pp > 1 else (0,):
                try:
                    spec = pair_planner_spec(cost, cfg, dp=dp, zero_stage=1, tp=TP, seed=args.seed, split_rank=split)
                except ValueError as exc:  # e.g. one stage, or the model states alone overflow a device
                    yield {**base, "split_rank": split, "method": "all", "error": str(exc)}
                    continue
                yield from _bench_config({**base, "split_rank": split}, batches, spec, max_input, max_target)


def _bench_config(base: dict, batches: list[np.ndarray], spec, max_input: int, max_target: int) -> Iterator[dict]:
    runs = [("dynapipe", lambda b: plan_pairs(b[:, 0], b[:, 1], spec))]
    if spec.pp > 1:  # backwards split where that fills the pipeline
        split = replace(spec, schedule="zero_bubble")
        runs.append(("dynapipe_zero_bubble", lambda b: plan_pairs(b[:, 0], b[:, 1], split)))
    runs += [
        (name, lambda b, fn=fn: fn(b[:, 0].tolist(), b[:, 1].tolist(), spec, max_input, max_target))
        for name, fn in PAIR_BASELINES.items()
    ]
    planned = None
    for method, fn in runs:
        rec = {**base, "method": method, "impl": "python", "batches": len(batches)}
        try:
            plans, times = timed_plans(fn, batches)
        except ValueError as exc:  # infeasible for this configuration
            yield {**rec, "error": str(exc)}
            continue
        iters = [p.iteration_ms for p in plans]
        rec.update(
            plan_summary(plans, times),
            recompute=dict(Counter(mb.recompute for p in plans for mb in p.micro_batches)),
            pairs=float(np.mean([len(b) for b in batches])),
        )
        if method == "dynapipe":
            planned = iters
        elif method == "dynapipe_zero_bubble" and planned is not None:
            rec["speedup_vs_dynapipe"] = float(np.mean([p / i for i, p in zip(iters, planned)]))
        elif planned is not None:
            rec["slowdown_vs_dynapipe"] = float(np.mean([i / p for i, p in zip(iters, planned)]))
        yield rec
