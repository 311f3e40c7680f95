"""``dynplugin`` console script (also ``python -m dyn_plugin``)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Each name is a module in dyn_plugin/commands with HELP, add_arguments() and run().
COMMANDS = ("report", "lengths", "analyze", "profile", "plan", "shard", "strategy", "bench", "megatron")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dynplugin", description="Plan variable-length training for DeepSpeed and Megatron."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"dyn_plugin.commands.{name}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        # Bad input is the user's to fix: say what and where, without a traceback.
        print(f"dynplugin {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
