"""``dynplugin lengths NAME --out FILE``: a real sequence-length distribution, or a distribution of
(input, target) length pairs (``tasks``), written to disk."""

from __future__ import annotations

import argparse
import json
import logging
import time

from ..cli_args import output_file

logger = logging.getLogger(__name__)

HELP = "measure a real sequence-length distribution (code, prose, mixture) or pair distribution (tasks)"

# Kept here rather than imported so `add_arguments` stays import-free; tests check they match.
NAMES = ("code", "prose", "mixture")
PAIR_NAMES = ("tasks",)  # (input, target) pairs: dyn_plugin.lengths.tasks.PAIR_DISTRIBUTIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", choices=NAMES + PAIR_NAMES, help="distribution to measure")
    parser.add_argument("--out", type=output_file, help="output file, .npy or .json")
    parser.add_argument("--bundled", action="store_true", help="copy the bundled lengths instead of tokenizing")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--update-bundled",
        action="store_true",
        help="recompute all distributions into dyn_plugin/lengths/bundled/ (maintainers)",
    )


def run(args: argparse.Namespace) -> int:
    from dyn_plugin.lengths import io as L

    if args.update_bundled:
        from dyn_plugin.lengths.bundle import update_bundled
        from dyn_plugin.lengths.pairs import format_pair_summary

        start = time.perf_counter()
        manifest = update_bundled(progress=not args.no_progress)
        for name, entry in manifest["distributions"].items():
            print(L.format_summary(name, entry["summary"]))
        for name, entry in manifest["pair_distributions"].items():
            print(format_pair_summary(name, entry["summary"]))
        print(f"wrote {L.BUNDLED_DIR} in {time.perf_counter() - start:.0f} s")
        return 0
    if args.name is None or args.out is None:
        raise ValueError("NAME and --out are required (or --update-bundled)")
    if not args.out.endswith((".npy", ".json")):  # fail before minutes of tokenizing, not after
        raise ValueError(f"--out {args.out!r} must end in .npy or .json")
    if args.name in PAIR_NAMES:
        return run_pairs(args)
    if args.bundled:
        lengths = L.load_lengths(args.name)
    else:
        start = time.perf_counter()
        lengths = L.compute_lengths(args.name, progress=not args.no_progress)
        logger.info("computed %s in %.1f s", args.name, time.perf_counter() - start)
    path = L.save_lengths(lengths, args.out)
    summary = L.summarize(lengths)
    if args.json:
        print(json.dumps({"name": args.name, "out": str(path), **summary}, indent=2))
    else:
        print(L.format_summary(args.name, summary))
        print(f"{summary['total_tokens']:,} tokens -> {path}")
    return 0


def run_pairs(args: argparse.Namespace) -> int:
    from dyn_plugin.lengths import pairs as P

    if args.bundled:
        pairs = P.load_pairs(args.name)
    else:
        start = time.perf_counter()
        pairs = P.compute_pairs(args.name, progress=not args.no_progress)
        logger.info("computed %s in %.1f s", args.name, time.perf_counter() - start)
    path = P.save_pairs(pairs, args.out)
    summary = P.summarize_pairs(pairs)
    if args.json:
        print(json.dumps({"name": args.name, "out": str(path), **summary}, indent=2))
    else:
        print(P.format_pair_summary(args.name, summary))
        print(
            f"{summary['input']['total_tokens']:,} input and {summary['target']['total_tokens']:,} target tokens -> {path}"
        )
    return 0
