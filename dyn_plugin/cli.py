"""``dynplugin`` console script (also ``python -m dyn_plugin``)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback

# Each name is a module in dyn_plugin/commands with HELP, add_arguments() and run().
COMMANDS = ("report", "lengths", "analyze", "profile", "plan", "shard", "strategy", "bench", "megatron")

# Bad input the user can fix: a value, a file, a config. Anything else is a bug in the plugin,
# still reported on one line (exit 1), its traceback behind --debug.
USER_ERRORS = (ValueError, OSError, RecursionError, OverflowError, MemoryError)


class OneLineParser(argparse.ArgumentParser):
    """argparse's refusals on one line (its default prints the whole usage first), exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="dynplugin", description="Plan variable-length training for DeepSpeed and Megatron.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--debug", action="store_true", help="on an error, print the traceback too")
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
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        # one line: a config with several problems lists them joined, not one per line
        message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        if isinstance(exc, USER_ERRORS):
            print(f"dynplugin {args.command}: error: {message}", file=sys.stderr)
            return 2
        hint = "" if args.debug else " (rerun with --debug for the traceback)"
        print(f"dynplugin {args.command}: internal error: {type(exc).__name__}: {message}{hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
