"""``dynplugin strategy``: propose heterogeneous strategies (Hydraulis) for a length distribution."""

from __future__ import annotations

import argparse
import logging
import time

from ..cli_args import RANKS, TOKENS, count, input_file, output_dir, output_file

HELP = (
    "propose heterogeneous parallel strategies (Hydraulis) for a length distribution: pipelines of different "
    "tensor/pipeline/sequence-parallel schemes; print them and write the proposal JSON"
)

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("lengths", help="lengths .npy/.json or a bundled distribution (code, prose, mixture)")
    parser.add_argument("--gpus", type=RANKS, help="GPUs of the cluster (default: the config's cluster size)")
    parser.add_argument(
        "--model",
        help="a model for simulated strategies over every (tp, pp, sp): gpt-6.7b (measured "
        "A100 tables) or llama-7b, llama-13b, llama-32b (calibrated on them)",
    )
    parser.add_argument(
        "--config",
        type=input_file,
        help="instead, a run's DeepSpeed JSON config (dyn_plugin section): strategies it "
        "can run (its tp and pipeline stages; sequence_parallel.sizes), for "
        "dyn_plugin.strategy.proposal",
    )
    parser.add_argument(
        "--tokens",
        type=TOKENS,
        help="tokens per step (default: 4096 per GPU, or the config's microbatching.global_tokens)",
    )
    parser.add_argument(
        "--max-len", type=TOKENS, default=32768, help="with --model: sequences are capped at this (default %(default)s)"
    )
    parser.add_argument("--max-strategies", type=count(1, 64), default=3, help="strategies besides the homogeneous one")
    parser.add_argument(
        "--cache",
        type=output_dir,
        help="a directory of proposals keyed by their inputs (JSON): reused when the inputs match",
    )
    parser.add_argument(
        "--out", default="strategy.json", type=output_file, help="where the proposal JSON goes (default %(default)s)"
    )
    parser.add_argument("--plot", metavar="PNG", type=output_file, help="the strategies' GPUs by scheme")


def run(args: argparse.Namespace) -> int:
    from ..lengths.io import load_lengths
    from ..plan.strategies.strategy import cached_proposal

    if (args.model is None) == (args.config is None):
        raise ValueError("give --model NAME (simulated strategies) or --config DS_JSON (a run's), one of them")
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
        from ..atomic import atomic_path
        from ..bench.strategy import plot_strategies

        with atomic_path(args.plot) as tmp:  # the plot written whole or not at all
            plot_strategies(proposal, tmp, title=f"{args.lengths}: {proposal.inputs.get('model', '')}")
        print(f"plot -> {args.plot}")
    return 0


def model_proposal(lengths, args: argparse.Namespace):
    """Every (tp, pp, sp) scheme of a named model on the A100 cluster: simulated strategies."""
    import numpy as np

    from ..bench.strategy import strategy_config
    from ..cost.calibrated import named_cost_model
    from ..plan.strategies.schemes import scheme_costs
    from ..plan.strategies.strategy import proposal_key, propose

    gpus = args.gpus if args.gpus is not None else 64
    tokens = args.tokens if args.tokens is not None else 4096 * gpus
    lens = np.minimum(lengths, args.max_len)
    cfg = strategy_config(args.max_len)
    kinds = scheme_costs(named_cost_model(args.model), cfg, gpus=gpus)
    key = proposal_key(lens, kinds, gpus=gpus, tokens=tokens, max_strategies=args.max_strategies, model=args.model)
    return (
        lambda: propose(lens, kinds, gpus=gpus, tokens=tokens, max_strategies=args.max_strategies, model=args.model)
    ), key


def config_proposal(lengths, args: argparse.Namespace):
    """The strategies a run of this config can execute (its tp and stages, sequence-parallel sizes)."""
    from ..config import load_config
    from ..cost.from_config import build_cost_model
    from ..lengths.io import cap_lengths
    from ..plan.steps.spec import planner_spec
    from ..plan.strategies.strategy import proposal_key, runnable_proposal, scheme_kinds

    plugin = load_config(args.config).plugin
    gpus = args.gpus if args.gpus is not None else plugin.cluster.world_size
    pp = plugin.pipeline.stages
    if gpus % pp:
        raise ValueError(f"--gpus {gpus} does not divide into pipeline.stages = {pp}; give a multiple of {pp}")
    spec = planner_spec(build_cost_model(plugin.cost_model, plugin.cluster), plugin, dp=gpus // pp, zero_stage=1)
    lens = cap_lengths(lengths, plugin.microbatching.max_seq_len, plugin.microbatching.truncate)
    tokens = args.tokens if args.tokens is not None else plugin.microbatching.global_tokens
    key = proposal_key(
        lens,
        [k for k in scheme_kinds(lens, spec) if k.longest > 0],
        gpus=gpus,
        tokens=tokens,
        max_strategies=args.max_strategies,
        model=spec.cost.name,
    )
    return (lambda: runnable_proposal(lens, spec, tokens=tokens, max_strategies=args.max_strategies)), key


def print_proposal(proposal) -> None:
    inp = proposal.inputs
    print(
        f"strategies for {inp.get('model', '?')} on {inp.get('gpus', '?')} GPUs, {inp.get('tokens', 0):,} tokens per "
        f"step, {inp.get('sequences', '?')} lengths up to {inp.get('longest', '?')} (key {proposal.key})"
    )
    print(f"{'holds up to':>12}  {'estimate ms':>11}  pipelines")
    for s in proposal.strategies:
        print(f"{s.longest:>12,}  {s.estimate_ms:>11.1f}  {s.describe()}")
