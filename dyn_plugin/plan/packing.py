"""Fixed-length packing: sequences into rows of a fixed token length, first-fit decreasing.

Megatron's packing and the strongest baseline use it; the planner also tries its rows as one
candidate (with its own recompute, balancing and schedule search on top).
"""
from __future__ import annotations

from typing import Sequence


def pack_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """First-fit decreasing into rows of ``row_len`` tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        s = lengths[i]
        if s > row_len:
            raise ValueError(f"sequence {i} (length {s}) is longer than the packing row ({row_len})")
        for r, room in enumerate(free):
            if s <= room:
                rows[r].append(i)
                free[r] -= s
                break
        else:
            rows.append([i])
            free.append(row_len - s)
    return rows
