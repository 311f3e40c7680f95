"""``dynplugin bench strategy``: Hydraulis's heterogeneous strategies against the seed's stage 1,
the best homogeneous strategy and DynaPipe, simulated at cluster scale.

Per (distribution, model, GPUs): the proposal is made once from the distribution (its time is
``propose_ms``); then global batches of ``tokens_per_gpu x GPUs`` tokens, sequences capped at
``max_len``, are planned by each method and simulated in the same simulator:

- ``hydraulis``: the proposal's strategies, stage 1 = ``plan/assignment/dispatch.py`` (greedy + local
  improvement, C++), stage 2 = DynaPipe's DP per pipeline, the fastest simulated strategy;
- ``seed_stage1``: the same strategies and stage 2, stage 1 = the seed's randomised greedy, best
  of 50 orders (``seed_dispatch``);
- ``homogeneous_best``: one scheme for every pipeline and step, the one whose steps simulate
  fastest in hindsight over the schemes that hold the longest sequence (same stages 1 and 2);
- ``dynapipe``: no sequence parallelism: DynaPipe's planner (``plan_step``) at the tp and pp
  (sp = 1) whose steps simulate fastest; infeasible where no such scheme holds the longest.

``plan_ms_p50``/``p99`` time planning one step (both stages for every pipeline plus the simulation;
for homogeneous_best, its one scheme), ``sim_iter_ms`` the mean simulated step; hydraulis and
seed_stage1 also record their stage-1 makespans on the same batches (``dispatch_ms``). Every
method records its peak memory per GPU over the steps (``peak_mem_mb``: activations by the
per-length fit of the measured tables, plus model states) against the device's limit
(``memory_limit_mb``, ``fits``; ``memory_record``).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import replace
from typing import Iterator

import numpy as np

from ..cli_args import RANK_COUNTS, SEED, STEPS, TOKENS, choices, count, fraction, output_dir
from ..cost.calibrated import MODELS, named_cost_model
from ..cost.table_memory import MeasuredLayerMemory
from ..lengths.corpus import DISTRIBUTIONS
from ..lengths.io import load_lengths
from ..plan.assignment.dispatch import dispatch, seed_dispatch
from ..plan.methods.planner import plan_step
from ..plan.steps.microbatch import InfeasibleError
from ..plan.strategies.schemes import scheme_costs
from ..plan.strategies.strategy import Strategy, plan_cluster_step, propose
from ..runtime.sampler import global_batches
from .memory import MB, measured_tables, memory_record

logger = logging.getLogger(__name__)

# The cluster of the measured A100 tables (their planner's 36000 MB limit, 8 GPUs per node), for --model
A100_CLUSTER = {"devices_per_node": 8, "device": {"name": "A100-40GB", "memory_mb": 36000, "memory_fraction": 1.0}}
RETRIES = 3  # plans for the memory less 1, 2, 3 x --memory-margin before a method is reported not fitting
HELP = (
    "heterogeneous strategies (hydraulis) against the seed's stage 1, the best "
    "homogeneous strategy and dynapipe: planning time per step and "
    "simulated step on A100 costs"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--distributions", type=choices(tuple(DISTRIBUTIONS)), default="code,prose,mixture")
    parser.add_argument(
        "--models",
        type=choices(tuple(MODELS)),
        default="gpt-6.7b",
        help="gpt-6.7b (measured A100 tables), llama-7b, llama-13b, llama-32b (calibrated on them)",
    )
    parser.add_argument("--gpus", type=RANK_COUNTS, default="64,1024")
    parser.add_argument("--tokens-per-gpu", type=TOKENS, default=4096, help="global batch = this x gpus tokens")
    parser.add_argument("--max-len", type=TOKENS, default=32768, help="sequences are capped at this")
    parser.add_argument("--max-strategies", type=count(1, 64), default=3)
    parser.add_argument("--batches", type=STEPS, default=8, help="global batches per configuration")
    parser.add_argument(
        "--plot-dir", type=output_dir, help="a plot per configuration: the strategies and one step's pipeline loads"
    )
    parser.add_argument("--seed", type=SEED, default=0)
    parser.add_argument(
        "--schedule",
        choices=("auto", "zero_bubble"),
        default="auto",
        help="pipeline.schedule every method's pipelines are planned with (zero_bubble: backwards split where "
        "that fills the pipeline)",
    )
    parser.add_argument(
        "--memory-margin",
        type=fraction(0.5),
        default=0.08,
        help="a method whose plans exceed the device's memory by the measured tables is planned again for "
        "this fraction less (default %(default)s: the most the tables measured above the cost model's "
        "estimate on this benchmark, 6.5%%; 0: no second try)",
    )


def strategy_config(max_len: int, memory_mb: float | None = None, schedule: str = "auto"):
    """The plugin config strategies of a named model are priced under (A100 cluster, ZeRO-1, packed);
    ``memory_mb``: plan for this much of the device (default: the cluster's limit); ``schedule``:
    the pipelines' ``pipeline.schedule``."""
    from ..config import DynPluginConfig

    cluster = A100_CLUSTER
    if memory_mb is not None:
        cluster = {**A100_CLUSTER, "device": {**A100_CLUSTER["device"], "memory_mb": memory_mb}}
    return DynPluginConfig.model_validate(
        {
            "microbatching": {"max_seq_len": max_len, "layout": "packed"},
            "sequence_parallel": {"enabled": True, "sizes": [1, 2, 4, 8]},
            "pipeline": {"schedule": schedule},
            "cluster": cluster,
        }
    )


def run(args: argparse.Namespace) -> Iterator[dict]:
    for model in args.models:
        cost = named_cost_model(model)
        for dist in args.distributions:
            lengths = np.minimum(load_lengths(dist), args.max_len)
            for gpus in args.gpus:
                yield from _bench_one(model, cost, dist, lengths, gpus, args)


def _bench_one(model: str, cost, dist: str, lengths: np.ndarray, gpus: int, args: argparse.Namespace) -> Iterator[dict]:
    """Every method planned for the device's memory; a method (for homogeneous_best and dynapipe:
    a scheme) whose plans exceed it by the measured tables is planned again for the memory less
    ``args.memory_margin``, up to ``RETRIES`` times that, so each runs with the most memory its
    plans fit in (``memory_budget_mb``)."""
    tokens = args.tokens_per_gpu * gpus
    base = {
        "benchmark": "strategy",
        "distribution": dist,
        "model": model,
        "gpus": gpus,
        "tokens": tokens,
        "max_len": args.max_len,
        "schedule": args.schedule,
    }
    limit_mb = float(A100_CLUSTER["device"]["memory_mb"])
    steps = RETRIES if args.memory_margin > 0 else 0
    budgets = [limit_mb * (1 - i * args.memory_margin) for i in range(steps + 1)]
    batches = [
        np.asarray([int(lengths[i]) for i in b]) for b in global_batches(lengths, tokens, args.batches, args.seed)
    ]
    tables = measured_tables(model)

    def fits(r: dict) -> bool:
        return r["memory"].get("fits_tables", r["memory"]["fits"])

    # each budget plans only what has not fitted yet: the strategies (hydraulis and seed_stage1
    # share a proposal) and the schemes of homogeneous_best and dynapipe
    chosen: dict = {"hydraulis": None, "seed_stage1": None, "homogeneous_best": {}, "dynapipe": {}}
    want: dict = {"strategies": True, "homogeneous_best": None, "dynapipe": None}  # None: every scheme
    for budget in budgets:
        got = _methods(model, cost, dist, lengths, gpus, batches, args, budget, limit_mb, tables, want)
        for method in ("hydraulis", "seed_stage1"):
            if want["strategies"] and (chosen[method] is None or not fits(chosen[method])):
                chosen[method] = got[method] or chosen[method]
        for method in ("homogeneous_best", "dynapipe"):
            for scheme, r in got[method].items():
                chosen[method][scheme] = r
        want = {
            "strategies": any(chosen[m] is not None and not fits(chosen[m]) for m in ("hydraulis", "seed_stage1")),
            "homogeneous_best": {sc for sc, r in chosen["homogeneous_best"].items() if not fits(r)},
            "dynapipe": {sc for sc, r in chosen["dynapipe"].items() if not fits(r)},
        }
        if not (want["strategies"] or want["homogeneous_best"] or want["dynapipe"]):
            break
    for method in ("homogeneous_best", "dynapipe"):  # the fastest scheme, each at the most memory it fits in
        ok = [r for r in chosen[method].values() if fits(r)] or list(chosen[method].values())
        chosen[method] = min(ok, key=lambda r: r["sim"], default=None)
    homo = chosen["homogeneous_best"]
    ref = homo["sim"] if homo else None
    for method in ("hydraulis", "seed_stage1", "homogeneous_best", "dynapipe"):
        r = chosen[method]
        if r is None:
            yield {**base, "method": method, "infeasible": True}
            continue
        yield {
            **base,
            "method": method,
            "plan_ms_p50": r["p50"],
            "plan_ms_p99": r["p99"],
            "sim_iter_ms": r["sim"],
            "speedup_vs_homogeneous": ref / r["sim"] if ref else None,
            "memory_budget_mb": r["budget_mb"],
            **r["memory"],
            **r["extra"],
        }
    hydra = chosen["hydraulis"]
    if args.plot_dir and hydra is not None:
        os.makedirs(args.plot_dir, exist_ok=True)
        path = os.path.join(args.plot_dir, f"strategy-{dist}-{model}-{gpus}.png")
        plot_strategies(
            hydra["proposal"],
            path,
            title=f"{dist}, {model}, {gpus} GPUs: hydraulis "
            f"{hydra['sim']:,.0f} ms vs homogeneous {homo['extra']['scheme'] if homo else '-'} "
            f"{ref or float('nan'):,.0f} ms per step (mean)",
            plan=hydra["plans"][0],
        )
        logger.info("plot -> %s", path)


def _methods(
    model: str,
    cost,
    dist: str,
    lengths: np.ndarray,
    gpus: int,
    batches: list[np.ndarray],
    args: argparse.Namespace,
    budget_mb: float,
    limit_mb: float,
    tables: MeasuredLayerMemory | None,
    want: dict,
) -> dict:
    """The methods ``want`` names planned for ``budget_mb`` of each device: hydraulis and
    seed_stage1 (``want["strategies"]``) as one result each (None where infeasible),
    homogeneous_best and dynapipe per scheme (``want[method]``: the schemes, None for all); each
    result carries its memory (``memory_record`` against ``limit_mb``) and its record's extra fields."""
    tokens = args.tokens_per_gpu * gpus
    cfg = strategy_config(args.max_len, budget_mb, args.schedule)
    kinds = scheme_costs(cost, cfg, gpus=gpus)
    by_scheme = {k.scheme: k for k in kinds}
    specs = {(k.scheme.tp, k.scheme.pp, k.scheme.sp): k.spec for k in kinds}

    def done(r: dict, extra: dict) -> dict | None:
        if not r["ok"]:
            return None
        memory = memory_record(r["plans"], specs, limit_mb * MB, tables=tables)
        return {**r, "memory": memory, "extra": extra, "budget_mb": budget_mb}

    out: dict = {"hydraulis": None, "seed_stage1": None}
    if want["strategies"]:
        t = time.perf_counter()
        proposal = propose(lengths, kinds, gpus=gpus, tokens=tokens, max_strategies=args.max_strategies, model=model)
        propose_ms = (time.perf_counter() - t) * 1e3
        logger.info(
            "%s %s %d GPUs, %.0f MB: %d schemes, proposal in %.0f ms: %s",
            model,
            dist,
            gpus,
            budget_mb,
            len(kinds),
            propose_ms,
            " | ".join(s.describe() for s in proposal.strategies),
        )
        hydra = _run(batches, lambda lens: plan_cluster_step(lens, proposal.strategies, by_scheme))
        # the seed's 50 trials run in C++ here (the same result as its Python twin, which is timed once below)
        seed = _run(
            batches, lambda lens: plan_cluster_step(lens, proposal.strategies, by_scheme, dispatcher=seed_dispatch)
        )
        # stage 1 alone, the same strategy and batch for both rules
        d_ours, d_seed, seed_python_ms = [], [], None
        for i, (lens, s) in enumerate(zip(batches, hydra.get("strategies", []))):
            order = list(dict.fromkeys(s.pipelines))
            times = np.stack([by_scheme[k].sequence_ms(lens) for k in order])
            kind_of, fill = [order.index(p) for p in s.pipelines], [k.pp - 1 for k in order]
            d_ours.append(dispatch(times, kind_of, fill, lens).makespan_ms)
            d_seed.append(seed_dispatch(times, kind_of, fill, lens, native=True).makespan_ms)
            if i == 0:
                t = time.perf_counter()
                seed_dispatch(times, kind_of, fill, lens)
                seed_python_ms = (time.perf_counter() - t) * 1e3
        stage1 = bool(d_ours)
        out["hydraulis"] = done(
            hydra,
            {
                "propose_ms": propose_ms,
                "dispatch_ms": float(np.mean(d_ours)) if stage1 else None,
                "strategies": [s.describe() for s in proposal.strategies],
                "bound_ms": bound_ms(batches, kinds, gpus),
            },
        )
        if out["hydraulis"] is not None:
            out["hydraulis"]["proposal"] = proposal
        out["seed_stage1"] = done(
            seed, {"dispatch_ms": float(np.mean(d_seed)) if stage1 else None, "python_dispatch_ms": seed_python_ms}
        )
    longest = int(lengths.max())
    out["homogeneous_best"] = {}
    for k in kinds:
        if k.longest < longest or gpus // k.scheme.gpus == 0:
            continue
        if want["homogeneous_best"] is not None and k.scheme not in want["homogeneous_best"]:
            continue
        only = Strategy((k.scheme,) * (gpus // k.scheme.gpus), k.longest)
        r = done(
            _run(batches, lambda lens: plan_cluster_step(lens, [only], by_scheme, method="homogeneous")),
            {"scheme": k.scheme.name},
        )
        if r is not None:
            out["homogeneous_best"][k.scheme] = r
    out["dynapipe"] = {}
    for k in kinds:
        if k.scheme.sp != 1 or k.longest < longest:
            continue
        if want["dynapipe"] is not None and k.scheme not in want["dynapipe"]:
            continue
        spec = replace(k.spec, dp=gpus // k.scheme.gpus)
        r = done(_run(batches, lambda lens: (plan_step(lens, spec), None)), {"scheme": k.scheme.name})
        if r is not None:
            out["dynapipe"][k.scheme] = r
    return out


def bound_ms(batches: list[np.ndarray], kinds, gpus: int) -> float:
    """A lower bound no strategy beats, mean over the batches: the larger of the batch's longest
    sequence alone on the scheme that runs it fastest (its update included), and the batch's
    work spread over every GPU at each sequence's cheapest GPU-time (plus the smallest update)."""
    out = []
    for lens in batches:
        alone = min(
            (
                plan_cluster_step(np.array([int(lens.max())]), [Strategy((k.scheme,), k.longest)], {k.scheme: k})[
                    0
                ].iteration_ms
                for k in kinds
                if k.longest >= lens.max()
            ),
            default=float("inf"),
        )
        gpu_ms = np.min(np.stack([k.sequence_ms(lens) * k.scheme.gpus for k in kinds]), axis=0)
        out.append(max(alone, float(gpu_ms.sum()) / gpus + min(k.update_ms for k in kinds)))
    return float(np.mean(out))


def _run(batches: list[np.ndarray], plan_one) -> dict:
    """Plan every batch (``plan_one`` -> (plan, strategy)), timing each; ok=False if one is infeasible."""
    times, plans, strategies = [], [], []
    for lens in batches:
        t = time.perf_counter()
        try:
            plan, strategy = plan_one(lens)
        except (InfeasibleError, ValueError) as exc:
            logger.debug("infeasible: %s", exc)
            return {"ok": False}
        times.append((time.perf_counter() - t) * 1e3)
        plans.append(plan)
        strategies.append(strategy)
    return {
        "ok": True,
        "strategies": strategies,
        "p50": float(np.percentile(times, 50)),
        "p99": float(np.percentile(times, 99)),
        "sim": float(np.mean([p.iteration_ms for p in plans])),
        "plans": plans,
    }


def plot_strategies(proposal, path: str, *, title: str = "", plan=None) -> None:
    """Left: each strategy's GPUs stacked by scheme. Right (with ``plan``): one step's simulated
    time per pipeline, coloured by scheme, busiest first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schemes = sorted({p for s in proposal.strategies for p in s.pipelines}, key=lambda p: (p.gpus, p.tp, p.pp, p.sp))
    colours = {p: plt.cm.tab20(i % 20) for i, p in enumerate(schemes)}
    fig, axes = plt.subplots(
        1, 2 if plan is not None else 1, figsize=(13 if plan is not None else 7, 4.5), squeeze=False
    )
    ax = axes[0][0]
    for x, s in enumerate(proposal.strategies):
        bottom = 0
        for p, n in sorted(s.counts.items(), key=lambda kv: -kv[0].gpus):
            ax.bar(
                x,
                n * p.gpus,
                bottom=bottom,
                color=colours[p],
                edgecolor="white",
                label=p.name if x == next(i for i, t in enumerate(proposal.strategies) if p in t.counts) else None,
            )
            if n * p.gpus >= 0.06 * s.gpus:
                ax.text(x, bottom + n * p.gpus / 2, f"{n}x", ha="center", va="center", fontsize=8)
            bottom += n * p.gpus
    ax.set_xticks(
        range(len(proposal.strategies)), [f"<= {s.longest:,}\n{s.estimate_ms:,.0f} ms" for s in proposal.strategies]
    )
    ax.set_xlabel("strategy (longest sequence it holds; simulated step on its design batches)")
    ax.set_ylabel("GPUs")
    ax.legend(fontsize=7, title="scheme", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("proposed strategies")
    if plan is not None:
        ax = axes[0][1]
        reps = sorted(plan.replicas, key=lambda r: -r.sim.makespan_ms)
        keys = [_scheme_of(r) for r in reps]
        ax.bar(
            range(len(reps)), [r.sim.makespan_ms for r in reps], width=1.0, color=[colours.get(k, "grey") for k in keys]
        )
        ax.axhline(plan.iteration_ms - plan.update_ms, color="k", lw=0.8, ls="--")
        ax.set_xlabel(f"pipeline (busiest first; {len(reps)} with work)")
        ax.set_ylabel("simulated pipeline time (ms)")
        ax.set_title(f"one step: {plan.iteration_ms:,.0f} ms incl. update")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _scheme_of(rep):
    from ..plan.strategies.schemes import Scheme

    return Scheme(rep.tp, len(rep.schedule.stages), rep.size)
