"""Fixed-length packing: sequences into rows of a fixed token length, first-fit decreasing.

The one packer of the project: the waste analysis measures what its rows cost, the
``packing_full``/``packing_varlen`` baselines run them, and the planner tries them as one
candidate (with its own recompute, balancing and schedule search on top). Encoder-decoder
pairs are packed by the same first fit, on both sides at once (``pack_pair_rows``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def pack_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Indices of ``lengths`` per row, first-fit decreasing into rows of ``row_len`` tokens.

    Longest first (ties by index); each row lists its samples in packing order, longest first.
    The scan for the first row with room is one vectorized comparison, so 1e5 samples pack in
    well under a second.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return []
    if lengths.max() > row_len:
        i = int(np.argmax(lengths > row_len))
        raise ValueError(
            f"sequence {i} (length {lengths[i]}) is longer than the packing row ({row_len}); truncate first"
        )
    return _first_fit(lengths, np.int64(row_len), np.argsort(-lengths, kind="stable"))


def pack_pair_rows(pairs: np.ndarray, max_input: int, max_target: int) -> list[list[int]]:
    """Indices of ``pairs`` (``[N, 2]``: input, target lengths) per row, first-fit decreasing.

    T5 packing keeps a pair together: a row holds whole pairs, its inputs packed into an encoder
    row of ``max_input`` tokens and its targets into a decoder row of ``max_target`` tokens, both
    bounds kept. Pairs go largest first, by the larger of the two shares of their row they take
    (the usual order for packing in two dimensions; ties by index), each into the first row with
    room on both sides.
    """
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    if len(pairs) == 0:
        return []
    caps = np.array([max_input, max_target])
    for c, side in enumerate(("input", "target")):
        if pairs[:, c].max() > caps[c]:
            i = int(np.argmax(pairs[:, c] > caps[c]))
            raise ValueError(
                f"pair {i} has {side} length {pairs[i, c]}, longer than the packing row ({caps[c]}); truncate first"
            )
    share = (pairs / caps).max(axis=1)
    return _first_fit(pairs, caps, np.argsort(-share, kind="stable"))


def _first_fit(sizes: np.ndarray, caps: np.ndarray, order: np.ndarray) -> list[list[int]]:
    """Rows of sample indices: each sample, in ``order``, into the first row with room for it, else
    a new row. ``sizes`` is ``[N]`` with a scalar ``caps``, or ``[N, k]`` with ``k`` caps, room
    needed in every column (the one-column case stays 1-D: twice as fast, and the planner packs often)."""
    free = np.empty((len(sizes), *np.shape(caps)), dtype=np.int64)  # at most one row per sample
    rows: list[list[int]] = []
    for i in order:
        s = sizes[i]
        fits = free[: len(rows)] >= s
        if fits.ndim > 1:
            fits = fits.all(axis=1)
        r = int(np.argmax(fits)) if rows else 0
        if not rows or not fits[r]:
            r = len(rows)
            rows.append([])
            free[r] = caps
        free[r] -= s
        rows[r].append(int(i))
    return rows
