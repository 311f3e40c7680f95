"""``dynplugin bench cost``: how fast the cost model prices micro-batches, the C++ evaluator
against its Python twin, on random micro-batches of the GPT-6.7B-class analytic model."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable

from ..cli_args import SEED, STEPS

HELP = "cost-model queries per second, C++ evaluator vs the Python twin"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--queries", type=STEPS, default=20000, help="micro-batches to price (default %(default)s)")
    parser.add_argument("--seed", type=SEED, default=0)


def run(args: argparse.Namespace) -> Iterable[dict]:
    return [bench_cost(args)]


def bench_cost(args: argparse.Namespace) -> dict:
    """Price random micro-batches of the GPT-6.7B-class analytic model on one 8-layer stage."""
    import numpy as np

    from ..config import DeviceSpec, ModelShape
    from ..cost.analytic import analytic_cost_model
    from ..cost.model import StageSpec, features
    from ..cost.table import evaluate_stage

    shape = ModelShape(
        hidden_size=4096, num_layers=32, num_heads=32, ffn_hidden_size=16384, vocab_size=50257, gated_mlp=False
    )
    model = analytic_cost_model(shape, DeviceSpec(name="a100", memory_mb=40000, peak_tflops=312))
    rng = np.random.default_rng(args.seed)
    sizes = rng.integers(1, 17, size=args.queries)
    lens = rng.integers(16, 4096, size=int(sizes.sum()))
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    batches = [lens[offsets[i] : offsets[i + 1]].tolist() for i in range(args.queries)]
    stage = StageSpec(8, first=False, last=False)
    table = model.table("packed", "none")
    out = {"benchmark": "cost", "queries": args.queries, "mean_sequences_per_query": float(sizes.mean())}

    t0 = time.perf_counter()
    py = [evaluate_stage(table, features(b, "packed"), stage).forward_ms for b in batches]
    out["python_us_per_query"] = (time.perf_counter() - t0) / args.queries * 1e6
    native = model.native("packed", "none")
    if native is None:
        out["native"] = "not built"
        return out
    t0 = time.perf_counter()
    many = native.stage_cost_many(lens, offsets, stage.num_layers, stage.first, stage.last)
    out["native_batched_us_per_query"] = (time.perf_counter() - t0) / args.queries * 1e6
    arrays = [np.asarray(b, dtype=np.int64) for b in batches]
    t0 = time.perf_counter()
    for a in arrays:
        native.stage_cost(a, stage.num_layers, stage.first, stage.last)
    out["native_single_call_us_per_query"] = (time.perf_counter() - t0) / args.queries * 1e6
    out["max_rel_diff_native_vs_python"] = float(np.max(np.abs(many[:, 0] - py) / np.array(py)))
    out["speedup_batched_vs_python"] = out["python_us_per_query"] / out["native_batched_us_per_query"]
    return out
