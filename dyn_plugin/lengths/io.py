"""Real sequence-length distributions: measure, load, validate, save and summarize them.

Planners for variable-length training are only as good as the length distributions they are
tuned on, and synthetic ones (log-normal, uniform) miss the long tail that makes padding and
attention expensive. The lengths here are token counts of real text (``corpus``) under a
tokenizer trained on the machine itself (``tokenizer``), so nothing is downloaded.

The tokenizer depends on the Python version (its training text is the stdlib), so lengths
computed on another machine differ slightly; ``load_lengths("code")`` reads the copies bundled
in ``bundled/`` instead, which are the same everywhere.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
from numpy.typing import ArrayLike

from dyn_plugin.atomic import atomic_path, write_json_atomic
from dyn_plugin.checks import MAX_TOKENS
from dyn_plugin.jsonfile import read_json
from dyn_plugin.lengths.corpus import DISTRIBUTIONS, iter_documents
from dyn_plugin.lengths.tasks import PAIR_DISTRIBUTIONS
from dyn_plugin.lengths.tokenizer import get_tokenizer, token_lengths

logger = logging.getLogger(__name__)

BUNDLED_DIR = Path(__file__).resolve().parent / "bundled"


def compute_lengths(name: str, *, progress: bool = True) -> np.ndarray:
    """Tokenize the real text of a distribution; slow (seconds to minutes), see ``load_lengths``."""
    texts = list(iter_documents(name))
    lengths = token_lengths(texts, get_tokenizer(), progress=progress, desc=name)
    # Whitespace-only texts are filtered earlier, so this only trips on a tokenizer bug.
    bad = np.flatnonzero(lengths <= 0)
    if len(bad):
        raise RuntimeError(f"{name}: document {bad[0]} tokenized to 0 tokens")
    return lengths


def _bad_entry(lengths: np.ndarray, mask: np.ndarray, why: str, entry: Callable[[int], str]) -> ValueError:
    i = int(np.flatnonzero(mask)[0])
    value = lengths[i].item()
    if isinstance(value, float) and value.is_integer():  # read as float64 to check the range: show it as given
        value = int(value)
    return ValueError(f"{entry(i)} = {value!r}: {why}")


def _is_integral(v: object) -> bool:
    if isinstance(v, (bool, np.bool_)):
        return False
    if isinstance(v, (int, np.integer)):
        return True
    return isinstance(v, (float, np.floating)) and float(v).is_integer()


def cap_lengths(lengths: np.ndarray, max_len: int, truncate: bool) -> np.ndarray:
    """Lengths no longer than ``microbatching.max_seq_len``: cut when the config asks for
    truncation, otherwise an error naming the first sample that is too long."""
    too_long = np.flatnonzero(lengths > max_len)
    if not len(too_long):
        return lengths
    i = int(too_long[0])
    if not truncate:
        raise ValueError(
            f"lengths[{i}] = {int(lengths[i])} exceeds microbatching.max_seq_len = {max_len} "
            f"({len(too_long)} samples do); set microbatching.truncate = true to cut them, "
            "or raise max_seq_len"
        )
    logger.info("truncating %d of %d samples to max_seq_len %d", len(too_long), len(lengths), max_len)
    return np.minimum(lengths, max_len)


def validate_lengths(
    values: ArrayLike, *, what: str = "lengths", entry: Callable[[int], str] | None = None
) -> np.ndarray:
    """Check and convert to int64; errors name the first bad index so a bad file is quick to fix.

    Integral floats (``3.0``) pass: JSON writers and numpy float arrays produce them. ``what``
    names the lengths in errors and ``entry(i)`` the i-th one (default ``lengths[i]``): the
    columns of ``pairs.validate_pairs`` are checked here too.
    """
    entry = entry or (lambda i: f"{what}[{i}]")
    # Lists go through an object array so "7" or None are reported as themselves, not coerced.
    arr = values if isinstance(values, np.ndarray) else np.asarray(values, dtype=object)
    if arr.dtype.kind not in "iufO":
        raise ValueError(f"{what} must be integers, got an array of {arr.dtype}")
    if arr.ndim != 1:
        hint = " (input/target pairs are read with --pairs)" if arr.ndim == 2 and arr.shape[1] == 2 else ""
        raise ValueError(f"{what} must be a 1-D list of ints, got an array of shape {arr.shape}{hint}")
    if arr.size == 0:
        raise ValueError(f"{what} is empty: need at least one sample")
    if arr.dtype.kind == "O":
        for i, v in enumerate(arr.tolist()):
            if not _is_integral(v):
                raise ValueError(f"{entry(i)} = {v!r}: {what} must be integers")
        # Python ints may exceed int64; float64 holds them all (exact up to 2**53, far above the cap)
        arr = arr.astype(np.float64)
    if arr.dtype.kind == "f":
        nonint = ~np.isfinite(arr) | (arr != np.round(arr))
        if nonint.any():
            raise _bad_entry(arr, nonint, f"{what} must be integers", entry)
    if (arr <= 0).any():
        raise _bad_entry(arr, arr <= 0, "every sample needs at least one token", entry)
    # checked before the cast: beyond int64 a length wraps to a negative number, and near it a sum overflows
    if (arr > MAX_TOKENS).any():
        raise _bad_entry(
            arr, arr > MAX_TOKENS, f"longer than any sequence (at most 2**40 = {MAX_TOKENS:,} tokens)", entry
        )
    return arr.astype(np.int64)


# a bundled pair distribution given where lengths are read: refused, naming what it holds
_PAIRS_INSTEAD = (PAIR_DISTRIBUTIONS, "(input, target) pairs, which encoder-decoders train on")


def load_lengths(source: str | os.PathLike) -> np.ndarray:
    """A bundled distribution by name, or a ``.npy`` / ``.json`` file, validated, as int64."""
    return load_checked(source, DISTRIBUTIONS, validate_lengths, "lengths", "ints", _PAIRS_INSTEAD)


def load_checked(
    source: str | os.PathLike,
    bundled: Iterable[str],
    validate: Callable[[object], np.ndarray],
    what: str,
    items: str,
    other: tuple[Iterable[str], str],
) -> np.ndarray:
    """``validate`` of a bundled array by name (one of ``bundled``), or of a ``.npy`` file, or of a
    ``.json`` file holding a list of ``items`` or an object with a ``what`` list; every error names
    the file. Lengths and (input, target) pairs (``pairs.load_pairs``) are read the same way;
    ``other``: the other kind's bundled names and what they hold, refused by name."""
    bundled = tuple(bundled)
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"{what} source {source!r}: expected a bundled name or a path")
    if isinstance(source, str) and source in other[0]:
        raise ValueError(
            f"{source!r} is a bundled distribution of {other[1]}; {what} are needed here: "
            f"{', '.join(bundled)}, or a .npy/.json file"
        )
    if isinstance(source, str) and source in bundled:
        path = BUNDLED_DIR / f"{source}.npy"
        if not path.exists():
            raise FileNotFoundError(f"bundled {path} is missing; regenerate: dynplugin lengths --update-bundled")
        return validate(np.load(path))
    path = Path(source)
    if path.suffix not in (".npy", ".json"):
        raise ValueError(
            f"{str(source)!r} is neither a bundled distribution ({', '.join(bundled)}) "
            "nor a path ending in .npy or .json"
        )
    if path.suffix == ".npy":
        arr = _load_npy(path, f"{what} file")
        return _in_file(path, lambda: validate(arr), f"{what} file")
    data = read_json(path, f"{what} file")
    if isinstance(data, dict):
        if what not in data:
            raise ValueError(f'{path}: a JSON object needs a "{what}" list, found keys {sorted(data)}')
        data = data[what]
    if not isinstance(data, list):
        raise ValueError(f'{path}: expected a JSON list of {items} or an object with a "{what}" list')
    return _in_file(path, lambda: validate(data), f"{what} file")


def _load_npy(path: Path, what: str) -> np.ndarray:
    if path.is_dir():
        raise ValueError(f"{what} {path} is a directory; give a .npy or .json file")
    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist") from None
    except (ValueError, OSError, EOFError) as exc:  # not .npy data, truncated, or pickled objects
        raise ValueError(f"{what} {path} is not a numpy .npy array: {exc}") from None


def _in_file(path: Path, check: Callable[[], np.ndarray], what: str) -> np.ndarray:
    """``check()``, its ValueError prefixed by the file it read."""
    try:
        return check()
    except ValueError as exc:
        raise ValueError(f"{what} {path}: {exc}") from None


def save_lengths(lengths: ArrayLike, path: str | os.PathLike) -> Path:
    """Write ``.npy`` (compact, exact dtype) or ``.json`` (readable by anything) by suffix."""
    return save_checked(validate_lengths(lengths), path, what="lengths")


def save_checked(arr: np.ndarray, path: str | os.PathLike, *, what: str) -> Path:
    """Write a validated array as ``.npy``, or as ``.json`` under the key ``what``, atomically."""
    path = Path(path)
    if path.suffix == ".npy":
        with atomic_path(path) as tmp:
            np.save(tmp, arr)
    elif path.suffix == ".json":
        write_json_atomic(path, {what: arr.tolist()})
    else:
        raise ValueError(f"cannot save {what} to {str(path)!r}: the path must end in .npy or .json")
    return path


def summarize(lengths: ArrayLike) -> dict:
    """Count, total and quantiles; p99 and max matter most, they set the padding and attention cost."""
    lengths = validate_lengths(lengths)
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {
        "count": int(lengths.size),
        "total_tokens": int(lengths.sum()),
        "mean": float(lengths.mean()),
        "min": int(lengths.min()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": int(lengths.max()),
    }


def format_summary(name: str, summary: dict) -> str:
    cols = ["count", "mean", "p50", "p90", "p99", "max"]
    header = f"{'distribution':<14}" + "".join(f"{c:>10}" for c in cols)
    row = f"{name:<14}" + "".join(f"{summary[c]:>10,.0f}" for c in cols)
    return f"{header}\n{row}"
