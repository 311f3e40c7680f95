"""``dynplugin analyze FILE``: padding/packing waste and DP imbalance of a length distribution;
``dynplugin analyze --pairs FILE`` (or a bundled pair name: ``tasks``): padding of padded and packed
(input, target) pairs, per side."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..cli_args import RANKS, SEED, TOKENS, count, output_file
from .lengths import PAIR_NAMES

HELP = "how much compute padding and packing waste on a length distribution or on (input, target) pairs"

# Mirrors dyn_plugin.lengths.analysis defaults; duplicated so building the parser imports nothing heavy.
DEFAULT_BATCH_SIZE = 8
DEFAULT_TOKEN_BUDGET = 2**20
DEFAULT_HIDDEN = 4096
DEFAULT_DP = 8


# Options of the single-lengths analysis only: refused with --pairs rather than silently unused.
LENGTHS_ONLY = ("plot", "token_budget", "max_len", "hidden", "dp")
PAIRS_ONLY = ("max_input", "max_target")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file",
        nargs="?",
        help="lengths .npy/.json, or a bundled distribution: code, prose, mixture (or tasks, pairs)",
    )
    parser.add_argument(
        "--pairs",
        metavar="PAIRS",
        help='analyze (input, target) pairs: a [N, 2] .npy, a JSON {"pairs": [[in, out], ...]}, '
        f"or a bundled pair distribution: {', '.join(PAIR_NAMES)}",
    )
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
        help=f"tokens per global batch for the DP imbalance (default {DEFAULT_TOKEN_BUDGET})",
    )
    parser.add_argument(
        "--max-len",
        type=TOKENS,
        help="packed row length and truncation point (default: power of two >= p99, at most token-budget/dp)",
    )
    parser.add_argument("--hidden", type=count(), help=f"model hidden size H (default {DEFAULT_HIDDEN})")
    parser.add_argument("--dp", type=RANKS, help=f"data-parallel ranks (default {DEFAULT_DP})")
    parser.add_argument(
        "--max-input",
        type=TOKENS,
        help="pairs: encoder row length and input truncation point (default: power of two >= the inputs' p99)",
    )
    parser.add_argument(
        "--max-target",
        type=TOKENS,
        help="pairs: decoder row length and target truncation point (default: power of two >= the targets' p99)",
    )
    parser.add_argument("--seed", type=SEED, default=0, help="shuffle seed (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the analysis as JSON")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def run(args: argparse.Namespace) -> int:
    if args.file is not None and args.pairs is not None:
        raise ValueError(f"give FILE or --pairs, not both (got {args.file!r} and --pairs {args.pairs!r})")
    if args.file is None and args.pairs is None:
        raise ValueError("give a lengths FILE, or --pairs PAIRS for (input, target) pairs")
    if args.pairs is not None or args.file in PAIR_NAMES:
        return run_pairs(args, args.pairs if args.pairs is not None else args.file)
    given = [_flag(d) for d in PAIRS_ONLY if getattr(args, d) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} apply to (input, target) pairs only (--pairs); use --max-len for lengths")

    from dyn_plugin.lengths.analysis import analyze, format_analysis, plot_analysis
    from dyn_plugin.lengths.io import load_lengths

    lengths = load_lengths(args.file)
    result = analyze(
        lengths,
        batch_size=args.batch_size,
        token_budget=DEFAULT_TOKEN_BUDGET if args.token_budget is None else args.token_budget,
        max_len=args.max_len,
        hidden=DEFAULT_HIDDEN if args.hidden is None else args.hidden,
        dp=DEFAULT_DP if args.dp is None else args.dp,
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


def run_pairs(args: argparse.Namespace, source: str) -> int:
    given = [_flag(d) for d in LENGTHS_ONLY if getattr(args, d) is not None]
    if given:
        raise ValueError(
            f"{', '.join(given)} apply to single lengths only: the pair analysis reports token slots per side "
            "(use --max-input/--max-target for the row lengths)"
        )
    from dyn_plugin.lengths.pair_analysis import analyze_pairs, format_pair_analysis
    from dyn_plugin.lengths.pairs import load_pairs

    result = analyze_pairs(
        load_pairs(source),
        batch_size=args.batch_size,
        max_input=args.max_input,
        max_target=args.max_target,
        seed=args.seed,
    )
    name = Path(source).stem
    if args.json:
        print(json.dumps({"name": name, **result.to_dict()}, indent=2))
    else:
        print(format_pair_analysis(result, name))
    return 0
