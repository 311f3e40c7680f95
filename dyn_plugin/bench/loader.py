"""``dynplugin bench loader``: the loader alone, with and without planning ahead.

Real planning work (A100 GPT-6.7B costs, pp=4, dp=2, bundled ``mixture`` lengths, 64k-token
global batches) on a synthetic dataset of those lengths. A training step is stood in for by a
sleep of ``step_ms``: with steps shorter than planning, a rank that plans for itself stalls for
the whole planning time each step, while planners working ahead through a store should hide it
once ``step_ms`` exceeds planning time / planners.
"""

from __future__ import annotations

import argparse
import time
from typing import Iterable, Iterator

import numpy as np

from ..cli_args import STEPS, count, numbers, redis_url
from ..layout import RankLayout

MAX_LEN = 8192
HELP = (
    "loader steps/s, time each step waits for its plan (planning locally or "
    "ahead through a store), store round-trip latency"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=STEPS, default=20)
    parser.add_argument(
        "--step-ms", type=numbers(-1.0), default="0,50,200", help="simulated training step times (ms), comma-separated"
    )
    parser.add_argument("--planners", type=count(1, 64), default=2)
    parser.add_argument("--prefetch", type=count(1, 1024), default=4)
    parser.add_argument(
        "--samples",
        type=STEPS,
        help="instead, the loader's own cost on a dataset of this many samples: "
        "start-up and per-step overhead, planning and collation left out",
    )
    parser.add_argument(
        "--redis-url",
        type=redis_url,
        help="measure this Redis server (password in $DYN_PLUGIN_REDIS_PASSWORD) rather "
        "than a throwaway local redis-server",
    )


def run(args: argparse.Namespace) -> Iterable[dict]:
    """The loader with and without planning ahead, then the stores' round trips; with ``--samples``
    instead, the loader's own cost at that dataset size."""
    if args.samples is not None:
        return [bench_loader_scale(args.samples, steps=args.steps)]
    return bench_loader(
        steps=args.steps, step_ms=args.step_ms, planners=args.planners, prefetch=args.prefetch, redis_url=args.redis_url
    )


class _Tokens:
    """Token ids of the right lengths, made on demand (no big allocation up front)."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(int(self.lengths[i]), 7, dtype=np.int64)


def _loader(store: dict, planners: int, prefetch: int, samples: int | None = None):
    from ..config import load_config
    from ..cost.from_config import build_cost_model
    from ..lengths.io import load_lengths
    from ..runtime.loader import DynLoader

    cfg = load_config(
        {
            "zero_optimization": {"stage": 1},
            "dyn_plugin": {
                # as examples/a100_gpt67b.json
                "cost_model": {"kind": "profile", "profile": "a100-gpt-6.7b", "dtype": "fp16"},
                "microbatching": {"global_tokens": 65536, "max_seq_len": MAX_LEN, "truncate": True},
                "pipeline": {"stages": 4},
                "cluster": {"devices_per_node": 8, "device": {"memory_mb": 72000, "memory_fraction": 1.0}},
                "store": store,
                "loader": {"planners": planners, "prefetch": prefetch},
            },
        }
    )
    lengths = np.minimum(load_lengths("mixture"), MAX_LEN)
    if samples is not None:  # the same distribution, as many samples as asked for
        lengths = np.random.default_rng(0).choice(lengths, size=samples)
    cost = build_cost_model(cfg.plugin.cost_model, cfg.plugin.cluster)
    return DynLoader(_Tokens(lengths), lengths=lengths, config=cfg, cost_model=cost, layout=RankLayout.of(2, 4), seed=0)


def bench_loader_scale(samples: int, steps: int = 20) -> dict:
    """What the loader itself costs at ``samples`` samples, planning and collation left out (they
    scale with the tokens of a step, not with the dataset): start-up (building it and the first
    epoch's batches, imports excluded) and, per step, the time in ``next()`` beyond them."""
    from ..runtime.loader import DynLoader

    t0 = time.perf_counter()
    loader = _loader({"backend": "none"}, 1, 1, samples=samples)
    batches = len(loader)
    startup = time.perf_counter() - t0
    collate_s: list[float] = []

    def timed_build(rank_plan, build=loader._build):
        t = time.perf_counter()
        step = build(rank_plan)
        collate_s.append(time.perf_counter() - t)
        return step

    loader._build = timed_build
    overhead = []
    it = iter(loader)
    for n in range(min(steps, batches)):
        t0 = time.perf_counter()
        next(it)
        overhead.append((time.perf_counter() - t0 - loader.plan_wait_s[n] - collate_s[n]) * 1e3)
    state = loader.state_dict()
    t0 = time.perf_counter()
    fresh = DynLoader(
        loader.dataset,
        lengths=loader.lengths,
        config=loader.config,
        cost_model=loader.context.cost,
        layout=RankLayout.of(2, 4),
        seed=0,
    )
    fresh.load_state_dict(state)
    resume = time.perf_counter() - t0
    return {
        "benchmark": "loader-scale",
        "samples": samples,
        "batches_per_epoch": batches,
        "startup_ms": startup * 1e3,
        "overhead_ms_p50": float(np.percentile(overhead, 50)),
        "overhead_ms_max": float(max(overhead)),
        "plan_ms_p50": float(np.percentile(loader.plan_wait_s, 50) * 1e3),
        "collate_ms_p50": float(np.percentile(collate_s, 50) * 1e3),
        "resume_ms": resume * 1e3,
        "steps": len(overhead),
    }


def bench_loader(
    steps: int = 20,
    step_ms: tuple[float, ...] = (0.0, 50.0, 200.0),
    planners: int = 2,
    prefetch: int = 4,
    port: int | None = None,
    redis_url: str | None = None,
) -> Iterator[dict]:
    if redis_url is not None:  # a dead server or a wrong password: said now, not after the loader runs
        from .store import check_redis

        check_redis(redis_url)
    modes = [("local", {"backend": "none"})]
    modes.append(("tcp-store", {"backend": "tcp", "namespace": f"bench-{time.time_ns()}", "port": port or 0}))
    for mode, store in modes:
        for ms in step_ms:
            loader = _loader(store, planners, prefetch)
            try:
                t0 = None
                for n, _ in enumerate(loader):
                    if n == 0:  # steady state: leave out planner start-up (first_wait_ms)
                        t0 = time.perf_counter()
                    if n + 1 >= steps:
                        break
                    time.sleep(ms / 1e3)
                elapsed = time.perf_counter() - t0
                waits = np.array(loader.plan_wait_s[1:]) * 1e3  # the first includes planner start-up
                yield {
                    "benchmark": "loader",
                    "mode": mode,
                    "planners": planners if mode != "local" else 0,
                    "step_ms": ms,
                    "steps": steps,
                    "steps_per_s": (steps - 1) / elapsed,
                    "plan_wait_ms_p50": float(np.percentile(waits, 50)),
                    "plan_wait_ms_p99": float(np.percentile(waits, 99)),
                    "first_wait_ms": loader.plan_wait_s[0] * 1e3,
                }
            finally:
                loader.close()
    from .store import bench_stores

    for row in bench_stores(redis_url=redis_url):
        yield {"benchmark": "store-round-trip", **row}
