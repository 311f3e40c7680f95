"""Lengths as (input, target) pairs, for encoder-decoder (T5) training: validate, load, save, summarize.

A pair distribution is an int64 array of shape ``[N, 2]``: column 0 the input (encoder) length,
column 1 the target (decoder) length of each sample, both at least 1. The two lengths vary
independently (a summary has a long input and a short target, generation the reverse), so
every statistic is kept per side. Files are read and written as lengths are (``io``): a bundled
name (``tasks``), a ``.npy`` array of shape ``[N, 2]``, or a JSON file ``{"pairs": [[in, out], ...]}``
(or the bare list); errors name the file, the entry and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
from numpy.typing import ArrayLike

from dyn_plugin.lengths.corpus import DISTRIBUTIONS
from dyn_plugin.lengths.io import load_checked, save_checked, summarize, validate_lengths
from dyn_plugin.lengths.tasks import PAIR_DISTRIBUTIONS, labeled_pairs
from dyn_plugin.lengths.tokenizer import get_tokenizer, token_lengths

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SIDES = ("input", "target")  # column 0, column 1


def validate_pairs(values: ArrayLike) -> np.ndarray:
    """Check and convert to int64 ``[N, 2]``; errors name the first bad pair and side.

    Each column is checked as lengths are (``io.validate_lengths``): integers (integral floats
    pass), at least 1, at most 2**40.
    """
    if isinstance(values, np.ndarray):
        arr = values
    elif isinstance(values, (list, tuple)):
        for i, v in enumerate(values):
            if not isinstance(v, (list, tuple)) or len(v) != 2:
                raise ValueError(f"pairs[{i}] = {v!r}: each pair is [input length, target length]")
        arr = np.empty((len(values), 2), dtype=object)  # keeps "7" or None as themselves for the error
        for i, v in enumerate(values):
            arr[i, 0], arr[i, 1] = v
    else:
        raise ValueError(f"pairs must be a list of [input length, target length], got {type(values).__name__}")
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(
            f"pairs must have shape [N, 2] (column 0 the input length, column 1 the target length), "
            f"got an array of shape {list(arr.shape)}"
        )
    if arr.shape[0] == 0:
        raise ValueError("pairs is empty: need at least one (input, target) pair")
    columns = [
        validate_lengths(arr[:, c], what=f"{side} lengths", entry=lambda i, c=c, side=side: f"pairs[{i}][{c}] ({side})")
        for c, side in enumerate(SIDES)
    ]
    return np.stack(columns, axis=1)


# a bundled distribution of sequence lengths given where pairs are read: refused, naming what it holds
_LENGTHS_INSTEAD = (DISTRIBUTIONS, "single sequence lengths, which decoder-only models train on")


def load_pairs(source: str | os.PathLike) -> np.ndarray:
    """A bundled pair distribution by name, or a ``.npy`` / ``.json`` file, validated, int64 ``[N, 2]``."""
    return load_checked(source, PAIR_DISTRIBUTIONS, validate_pairs, "pairs", "[input, target] pairs", _LENGTHS_INSTEAD)


def save_pairs(pairs: ArrayLike, path: str | os.PathLike) -> Path:
    """Write ``.npy`` (shape ``[N, 2]``) or ``.json`` (``{"pairs": [[in, out], ...]}``) by suffix, atomically."""
    return save_checked(validate_pairs(pairs), path, what="pairs")


def compute_pairs(name: str, *, progress: bool = True) -> np.ndarray:
    """Tokenize the text pairs of a pair distribution (``tasks.labeled_pairs``); slow, see ``load_pairs``."""
    return pair_lengths([pair for _, pair in labeled_pairs(name)], progress=progress, desc=name)


def pair_lengths(
    texts: Sequence[tuple[str, str]], tokenizer: Tokenizer | None = None, *, progress: bool = False, desc: str = "pairs"
) -> np.ndarray:
    """Token counts ``[N, 2]`` of (input, target) texts under the project tokenizer (or ``tokenizer``)."""
    tokenizer = tokenizer or get_tokenizer()
    sides = [
        token_lengths([t[c] for t in texts], tokenizer, progress=progress, desc=f"{desc} {side}s")
        for c, side in enumerate(SIDES)
    ]
    # Empty texts are filtered when the pairs are cut, so this only trips on a tokenizer bug.
    return validate_pairs(np.stack(sides, axis=1))


def summarize_pairs(pairs: ArrayLike) -> dict:
    """Per side ``io.summarize`` (count, total, mean, quantiles, max), and how the sides correlate.

    ``correlation`` is Pearson's of the two lengths, ``log_correlation`` of their logarithms
    (lengths span orders of magnitude, so the log one is not dominated by a few long samples);
    both 0.0 when a side is constant. ``target_longer`` is the share of pairs whose target is
    longer than their input.
    """
    pairs = validate_pairs(pairs)
    x, y = pairs[:, 0].astype(np.float64), pairs[:, 1].astype(np.float64)
    return {
        "count": int(len(pairs)),
        "input": summarize(pairs[:, 0]),
        "target": summarize(pairs[:, 1]),
        "correlation": _pearson(x, y),
        "log_correlation": _pearson(np.log(x), np.log(y)),
        "target_longer": float((y > x).mean()),
    }


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    dx, dy = x - x.mean(), y - y.mean()
    denom = np.sqrt((dx * dx).sum() * (dy * dy).sum())
    return float((dx * dy).sum() / denom) if denom > 0 else 0.0


def format_pair_summary(name: str, summary: dict) -> str:
    cols = ["count", "mean", "p50", "p90", "p99", "max"]
    lines = [f"{name:<14}" + "".join(f"{c:>10}" for c in cols)]
    for side in SIDES:
        lines.append(f"  {side:<12}" + "".join(f"{summary[side][c]:>10,.0f}" for c in cols))
    lines.append(
        f"correlation {summary['correlation']:.2f} (of log lengths {summary['log_correlation']:.2f}); "
        f"target longer than input in {100 * summary['target_longer']:.1f}% of pairs"
    )
    return "\n".join(lines)
