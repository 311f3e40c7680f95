"""Argument types of every ``dynplugin`` flag: each flag is checked while the command line is
parsed, so a bad value is refused (exit 2, one line naming the flag) before any work starts.

At the bottom (standard library only) so both the commands and the benchmarks below them, which
define their own sub-commands' flags, take them from here. Bounds come from
:mod:`dyn_plugin.checks`, the same check the public API runs."""

from __future__ import annotations

import argparse
import os
from typing import Callable

from .checks import MAX_COUNT, MAX_RANKS, MAX_SEED, MAX_TOKENS, check_count, check_number


def count(low: int = 1, high: int = MAX_COUNT) -> Callable[[str], int]:
    """An integer in ``[low, high]``."""
    return _parsed(int, "an integer", lambda v: check_count("value", v, low, high))


def counts(low: int = 1, high: int = MAX_COUNT) -> Callable[[str], tuple[int, ...]]:
    """Comma-separated integers, each in ``[low, high]``: ``8,32``."""
    one = count(low, high)

    def parse(text: str) -> tuple[int, ...]:
        return tuple(one(part) for part in text.split(","))

    return parse


def number(low: float = 0.0) -> Callable[[str], float]:
    """A finite number above ``low`` (MB, ms, a fraction)."""
    return _parsed(float, "a number", lambda v: check_number("value", v, low))


def fraction(high: float = 1.0) -> Callable[[str], float]:
    """A number in ``[0, high]`` (0 turns the thing off)."""
    return _parsed(float, "a number", lambda v: 0.0 if v == 0 else check_number("value", v, 0.0, high))


def _parsed(convert: Callable[[str], object], kind: str, check: Callable[[object], object]) -> Callable[[str], object]:
    """Text -> value -> checked value, each failure an ArgumentTypeError argparse prints after the flag."""

    def parse(text: str) -> object:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        try:
            return check(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value = ")) from None

    return parse


def numbers(low: float = 0.0) -> Callable[[str], tuple[float, ...]]:
    one = number(low)
    return lambda text: tuple(one(part) for part in text.split(","))


def powers_of_two(high: int = MAX_RANKS) -> Callable[[str], tuple[int, ...]]:
    """Comma-separated powers of two up to ``high``: group sizes (``1,2,4,8``)."""
    many = counts(1, high)

    def parse(text: str) -> tuple[int, ...]:
        sizes = many(text)
        bad = [k for k in sizes if k & (k - 1)]
        if bad:
            raise argparse.ArgumentTypeError(f"{','.join(map(str, bad))}: group sizes are powers of two (1, 2, 4, ...)")
        return sizes

    return parse


def grids(text: str) -> tuple[tuple[int, int], ...]:
    """Comma-separated ``PPxDP`` pipeline x data-parallel layouts (``1x1,4x2``), each at least 1x1."""
    one = count(1, MAX_RANKS)
    out = []
    for part in text.split(","):
        pp, x, dp = part.partition("x")
        if not x:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not PPxDP (pipeline stages x data-parallel columns, e.g. 4x2)"
            )
        out.append((one(pp), one(dp)))
    return tuple(out)


def choices(allowed: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """Comma-separated names, each one of ``allowed``."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(text.split(","))
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{','.join(bad)!r}: expected names among {', '.join(allowed)}")
        return names

    return parse


def input_file(text: str) -> str:
    """An existing file (not a directory)."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file")
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    return text


def output_file(text: str) -> str:
    """A file to write: its directory exists and it is not itself a directory (checked now, not
    after minutes of measuring)."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text}: directory {parent} does not exist; create it first")
    return text


def output_dir(text: str) -> str:
    """A directory to write into (created if missing): not an existing file."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a file; give a directory")
    return text


def redis_url(text: str) -> str:
    """A Redis URL: redis://, rediss:// (TLS) or unix:// (a socket)."""
    if not text.startswith(("redis://", "rediss://", "unix://")):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a Redis URL (redis://host:port/db, rediss://..., unix://...)"
        )
    return text


RANKS = count(1, MAX_RANKS)
TOKENS = count(1, MAX_TOKENS)
STEPS = count()
SEED = count(0, MAX_SEED)
RANK_COUNTS = counts(1, MAX_RANKS)  # comma-separated: GPUs, pipeline stages
TOKEN_COUNTS = counts(1, MAX_TOKENS)  # comma-separated: global tokens, sequence caps
