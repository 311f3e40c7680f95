"""Fixed-length packing: sequences into rows of a fixed token length, first-fit decreasing.

The one packer of the project: the waste analysis measures what its rows cost, the
``packing_full``/``packing_varlen`` baselines run them, and the planner tries them as one
candidate (with its own recompute, balancing and schedule search on top).
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
    free = np.empty(len(lengths), dtype=np.int64)  # at most one row per sample
    rows: list[list[int]] = []
    for i in np.argsort(-lengths, kind="stable"):
        s = lengths[i]
        fits = free[: len(rows)] >= s
        r = int(np.argmax(fits)) if rows else 0
        if not rows or not fits[r]:
            r = len(rows)
            rows.append([])
            free[r] = row_len
        free[r] -= s
        rows[r].append(int(i))
    return rows
