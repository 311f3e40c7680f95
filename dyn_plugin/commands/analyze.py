"""``dynplugin analyze FILE``: padding/packing waste and DP imbalance of a length distribution."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .args import RANKS, SEED, TOKENS, count, output_file

HELP = "how much compute padding and packing waste on a length distribution (Hydraulis/DCP analysis)"

# Mirrors dyn_plugin.lengths.analysis defaults; duplicated so building the parser imports nothing heavy.
DEFAULT_BATCH_SIZE = 8
DEFAULT_TOKEN_BUDGET = 2**20
DEFAULT_HIDDEN = 4096
DEFAULT_DP = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="lengths .npy/.json, or a bundled distribution: code, prose, mixture")
    parser.add_argument("--plot", metavar="PNG", type=output_file, help="write a summary figure here")
    parser.add_argument(
        "--batch-size",
        type=count(),
        default=DEFAULT_BATCH_SIZE,
        help="samples per padded batch (default %(default)s)",
    )
    parser.add_argument(
        "--token-budget",
        type=TOKENS,
        default=DEFAULT_TOKEN_BUDGET,
        help="tokens per global batch for the DP imbalance (default %(default)s)",
    )
    parser.add_argument(
        "--max-len",
        type=TOKENS,
        help="packed row length and truncation point (default: power of two >= p99, at most token-budget/dp)",
    )
    parser.add_argument(
        "--hidden", type=count(), default=DEFAULT_HIDDEN, help="model hidden size H (default %(default)s)"
    )
    parser.add_argument("--dp", type=RANKS, default=DEFAULT_DP, help="data-parallel ranks (default %(default)s)")
    parser.add_argument("--seed", type=SEED, default=0, help="shuffle seed (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the analysis as JSON")


def run(args: argparse.Namespace) -> int:
    from dyn_plugin.lengths.analysis import analyze, format_analysis, plot_analysis
    from dyn_plugin.lengths.io import load_lengths

    lengths = load_lengths(args.file)
    result = analyze(
        lengths,
        batch_size=args.batch_size,
        token_budget=args.token_budget,
        max_len=args.max_len,
        hidden=args.hidden,
        dp=args.dp,
        seed=args.seed,
    )
    name = Path(args.file).stem
    if args.json:
        print(json.dumps({"name": name, **result.to_dict()}, indent=2))
    else:
        print(format_analysis(result, name))
    if args.plot:
        path = plot_analysis(lengths, result, args.plot, name)
        if not args.json:
            print(f"plot -> {path}")
    return 0
