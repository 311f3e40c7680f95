"""The one check for counts, sizes and seeds given by a user (CLI flags, public API arguments).

Bounds are far above any real run and far below what would allocate or loop for ever: ``2**63``
steps or ranks must be refused before work starts, not discovered an hour into it."""

from __future__ import annotations

import math
import numbers

MAX_RANKS = 2**20  # devices in a cluster
MAX_TOKENS = 2**40  # tokens in a batch, a budget or a sequence
MAX_COUNT = 2**31 - 1  # steps, batches, repeats, queries, samples, threads, layers, widths
MAX_SEED = 2**32 - 1  # numpy's seed range


def check_count(name: str, value: object, low: int = 1, high: int = MAX_COUNT) -> int:
    """``value`` as an int within ``[low, high]``, else a ValueError naming ``name``, the value and the range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} = {value!r}: expected an integer in [{low}, {high:,}]")
    if not low <= value <= high:
        raise ValueError(f"{name} = {value}: expected an integer in [{low}, {high:,}]")
    return int(value)


def check_number(name: str, value: object, low: float = 0.0, high: float = math.inf) -> float:
    """``value`` as a finite float within ``(low, high]``: a positive amount (MB, ms, fraction)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} = {value!r}: expected a finite number above {low:g}")
    if not low < value <= high:
        raise ValueError(
            f"{name} = {value!r}: expected a number above {low:g}" + (f", at most {high:g}" if high < math.inf else "")
        )
    return float(value)
