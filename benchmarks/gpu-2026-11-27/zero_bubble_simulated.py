"""The plugin's plans with and without split backwards, priced by the H200 profile's measured
forward, backward and weight-gradient times (one GPU runs no pipeline, so they are simulated).

    .venv/bin/python benchmarks/gpu-2026-11-27/zero_bubble_simulated.py   # from the package root, on any CPU

Writes ``zero-bubble-h200-simulated.jsonl`` beside this file: per (documents up to, global batch,
pp x dp), the mean step of 20 global batches of code documents under the plugin's own schedules
(1F1B / adaptive), under zero-bubble schedules, and with long sequences cut into token slices
(``plan/steps/token_slices.py``'s what-if), each against the ideal step.
"""

import collections
import json
import os
from dataclasses import replace

import numpy as np

from dyn_plugin.config import DynPluginConfig
from dyn_plugin.cost.profile import cost_model_from_profile, load_profile
from dyn_plugin.lengths.io import load_lengths
from dyn_plugin.plan.methods.planner import plan_step
from dyn_plugin.plan.steps.bounds import ideal_ms
from dyn_plugin.plan.steps.spec import planner_spec
from dyn_plugin.plan.steps.token_slices import sliced_step_ms
from dyn_plugin.runtime.sampler import global_batches

HERE = os.path.dirname(os.path.abspath(__file__))
GRID = ((8192, 65536), (32768, 262144))  # documents up to, tokens a global batch
PARALLEL = ((4, 2), (2, 4))  # pp x dp


def summary(plans, batches, spec) -> dict:
    steps = [p.iteration_ms for p in plans]
    ideal = [ideal_ms(b, spec) for b in batches]
    return {
        "ms": float(np.mean(steps)),
        "vs_ideal": float(np.mean([s / d for s, d in zip(steps, ideal)])),
        "bubble": float(np.mean([p.bubble_fraction for p in plans])),
        "schedules": dict(collections.Counter(r.schedule.name for p in plans for r in p.replicas)),
    }


def main() -> None:
    cost = cost_model_from_profile(load_profile(os.path.join(HERE, "profile-h200-bf16-32k.json")))
    records = []
    for max_len, tokens in GRID:
        lengths = np.minimum(load_lengths("code"), max_len)
        batches = [[int(lengths[i]) for i in b] for b in global_batches(lengths, tokens, 20, 0)]
        for pp, dp in PARALLEL:
            cfg = DynPluginConfig.model_validate(
                {
                    "pipeline": {"stages": pp},
                    "microbatching": {"max_seq_len": max_len},
                    "cluster": {"devices_per_node": 8, "device": {"memory_mb": 139000, "memory_fraction": 0.9}},
                    "sequence_parallel": {"pyramid": True},
                }
            )
            spec = planner_spec(cost, cfg, dp=dp, zero_stage=1, seed=0)
            split = replace(spec, schedule="zero_bubble")
            whole = summary([plan_step(b, spec, native=True) for b in batches], batches, spec)
            plans = [plan_step(b, split, native=True) for b in batches]
            sliced = [sliced_step_ms(p, split)[0] for p in plans]
            ideal = [ideal_ms(b, split) for b in batches]
            record = {
                "max_len": max_len,
                "global_tokens": tokens,
                "pp": pp,
                "dp": dp,
                "auto": whole,
                "zero_bubble": summary(plans, batches, split),
                "token_slices_what_if": {
                    "ms": float(np.mean(sliced)),
                    "vs_ideal": float(np.mean([s / d for s, d in zip(sliced, ideal)])),
                },
            }
            record["speedup"] = whole["ms"] / record["zero_bubble"]["ms"]
            print(json.dumps(record))
            records.append(record)
    with open(os.path.join(HERE, "zero-bubble-h200-simulated.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
