"""``dynplugin strategy``: propose heterogeneous strategies (Hydraulis) for a length distribution."""
from __future__ import annotations

import argparse
import logging
import time

HELP = ("propose heterogeneous parallel strategies (Hydraulis) for a length distribution: pipelines of different "
        "tensor/pipeline/sequence-parallel schemes; print them and write the proposal JSON")

logger = logging.getLogger(__name__)

# The cluster of the measured A100 tables (their planner's 36000 MB limit, 8 GPUs per node), for --model
A100_CLUSTER = {"devices_per_node": 8, "device": {"name": "A100-40GB", "memory_mb": 36000, "memory_fraction": 1.0}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("lengths", help="lengths .npy/.json or a bundled distribution (code, prose, mixture)")
    parser.add_argument("--gpus", type=int, help="GPUs of the cluster (default: the config's cluster size)")
    parser.add_argument("--model", help="a model for simulated strategies over every (tp, pp, sp): gpt-6.7b (measured "
                                        "A100 tables) or llama-7b, llama-13b, llama-32b (calibrated on them)")
    parser.add_argument("--config", help="instead, a run's DeepSpeed JSON config (dyn_plugin section): strategies it can "
                                         "run (its tp and pipeline stages; sequence_parallel.sizes), for "
                                         "dyn_plugin.strategy.proposal")
    parser.add_argument("--tokens", type=int, help="tokens per step (default: 4096 per GPU, or the config's "
                                                   "microbatching.global_tokens)")
    parser.add_argument("--max-len", type=int, default=32768, help="with --model: sequences are capped at this "
                                                                   "(default %(default)s)")
    parser.add_argument("--max-strategies", type=int, default=3, help="strategies besides the homogeneous one")
    parser.add_argument("--cache", help="a directory of proposals keyed by their inputs (JSON): reused when the inputs "
                                        "match")
    parser.add_argument("--out", default="strategy.json", help="where the proposal JSON goes (default %(default)s)")
    parser.add_argument("--plot", metavar="PNG", help="the strategies' GPUs by scheme")


def run(args: argparse.Namespace) -> int:
    from ..lengths.io import load_lengths
    from ..plan.strategy import cached_proposal

    if (args.model is None) == (args.config is None):
        raise SystemExit("dynplugin strategy: give --model NAME (simulated strategies) or --config DS_JSON (a run's)")
    lengths = load_lengths(args.lengths)
    if args.model:
        make, key = model_proposal(lengths, args)
    else:
        make, key = config_proposal(lengths, args)
    t = time.perf_counter()
    proposal = cached_proposal(key, args.cache, make) if args.cache else make()
    logger.info("proposal in %.0f ms", (time.perf_counter() - t) * 1e3)
    proposal.save(args.out)
    print_proposal(proposal)
    print(f"proposal -> {args.out}")
    if args.plot:
        plot_strategies(proposal, args.plot, title=f"{args.lengths}: {proposal.inputs.get('model', '')}")
        print(f"plot -> {args.plot}")
    return 0


def model_proposal(lengths, args: argparse.Namespace):
    """Every (tp, pp, sp) scheme of a named model on the A100 cluster: simulated strategies."""
    import numpy as np

    from ..cost.calibrated import named_cost_model
    from ..plan.schemes import scheme_costs
    from ..plan.strategy import proposal_key, propose

    gpus = args.gpus or 64
    tokens = args.tokens or 4096 * gpus
    lens = np.minimum(lengths, args.max_len)
    cfg = strategy_config(args.max_len)
    kinds = scheme_costs(named_cost_model(args.model), cfg, gpus=gpus)
    key = proposal_key(lens, kinds, gpus=gpus, tokens=tokens, max_strategies=args.max_strategies, model=args.model)
    return (lambda: propose(lens, kinds, gpus=gpus, tokens=tokens, max_strategies=args.max_strategies,
                            model=args.model)), key


def config_proposal(lengths, args: argparse.Namespace):
    """The strategies a run of this config can execute (its tp and stages, sequence-parallel sizes)."""
    from ..config import load_config
    from ..cost.from_config import build_cost_model
    from ..lengths.io import cap_lengths
    from ..plan.planner import planner_spec
    from ..plan.strategy import proposal_key, runnable_proposal, scheme_kinds

    plugin = load_config(args.config).plugin
    gpus = args.gpus or plugin.cluster.world_size
    pp = plugin.pipeline.stages
    if gpus % pp:
        raise SystemExit(f"dynplugin strategy: {gpus} GPUs do not divide into pipeline.stages = {pp}")
    spec = planner_spec(build_cost_model(plugin.cost_model, plugin.cluster), plugin, dp=gpus // pp, zero_stage=1)
    lens = cap_lengths(lengths, plugin.microbatching.max_seq_len, plugin.microbatching.truncate)
    tokens = args.tokens or plugin.microbatching.global_tokens
    key = proposal_key(lens, [k for k in scheme_kinds(lens, spec) if k.longest > 0], gpus=gpus, tokens=tokens,
                       max_strategies=args.max_strategies, model=spec.cost.name)
    return (lambda: runnable_proposal(lens, spec, tokens=tokens, max_strategies=args.max_strategies)), key


def strategy_config(max_len: int):
    """The plugin config strategies of a named model are priced under (A100 cluster, ZeRO-1, packed)."""
    from ..config import DynPluginConfig

    return DynPluginConfig.model_validate({
        "microbatching": {"max_seq_len": max_len, "layout": "packed"},
        "sequence_parallel": {"enabled": True, "sizes": [1, 2, 4, 8]},
        "cluster": A100_CLUSTER,
    })


def print_proposal(proposal) -> None:
    inp = proposal.inputs
    print(f"strategies for {inp.get('model', '?')} on {inp.get('gpus', '?')} GPUs, {inp.get('tokens', 0):,} tokens per "
          f"step, {inp.get('sequences', '?')} lengths up to {inp.get('longest', '?')} (key {proposal.key})")
    print(f"{'holds up to':>12}  {'estimate ms':>11}  pipelines")
    for s in proposal.strategies:
        print(f"{s.longest:>12,}  {s.estimate_ms:>11.1f}  {s.describe()}")


def plot_strategies(proposal, path: str, *, title: str = "", plan=None) -> None:
    """Left: each strategy's GPUs stacked by scheme. Right (with ``plan``): one step's simulated
    time per pipeline, coloured by scheme, busiest first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schemes = sorted({p for s in proposal.strategies for p in s.pipelines}, key=lambda p: (p.gpus, p.tp, p.pp, p.sp))
    colours = {p: plt.cm.tab20(i % 20) for i, p in enumerate(schemes)}
    fig, axes = plt.subplots(1, 2 if plan is not None else 1, figsize=(13 if plan is not None else 7, 4.5),
                             squeeze=False)
    ax = axes[0][0]
    for x, s in enumerate(proposal.strategies):
        bottom = 0
        for p, n in sorted(s.counts.items(), key=lambda kv: -kv[0].gpus):
            ax.bar(x, n * p.gpus, bottom=bottom, color=colours[p], edgecolor="white",
                   label=p.name if x == next(i for i, t in enumerate(proposal.strategies) if p in t.counts) else None)
            if n * p.gpus >= 0.06 * s.gpus:
                ax.text(x, bottom + n * p.gpus / 2, f"{n}x", ha="center", va="center", fontsize=8)
            bottom += n * p.gpus
    ax.set_xticks(range(len(proposal.strategies)), [f"<= {s.longest:,}" for s in proposal.strategies])
    ax.set_xlabel("strategy (longest sequence it holds)")
    ax.set_ylabel("GPUs")
    ax.legend(fontsize=7, title="scheme", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("proposed strategies")
    if plan is not None:
        ax = axes[0][1]
        reps = sorted(plan.replicas, key=lambda r: -r.sim.makespan_ms)
        keys = [_scheme_of(r) for r in reps]
        ax.bar(range(len(reps)), [r.sim.makespan_ms for r in reps], width=1.0,
               color=[colours.get(k, "grey") for k in keys])
        ax.axhline(plan.iteration_ms - plan.update_ms, color="k", lw=0.8, ls="--")
        ax.set_xlabel(f"pipeline (busiest first; {len(reps)} with work)")
        ax.set_ylabel("simulated pipeline time (ms)")
        ax.set_title(f"one step: {plan.iteration_ms:,.0f} ms incl. update")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _scheme_of(rep):
    from ..plan.schemes import Scheme

    return Scheme(rep.tp, len(rep.schedule.stages), rep.size)
