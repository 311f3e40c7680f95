"""Global batches by token budget: the unit every plan is made for."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def global_batches(lengths: Sequence[int], tokens: int, count: int, seed: int) -> list[list[int]]:
    """Sample indices of ``count`` consecutive global batches of a seeded shuffle, each filled
    with whole sequences up to ``tokens`` (a sequence longer than the budget makes a batch alone).
    Epochs repeat, reshuffled, until ``count`` batches are full."""
    lengths = np.asarray(lengths)
    if tokens <= 0 or count <= 0:
        raise ValueError(f"need a positive token budget and batch count, got {tokens} and {count}")
    batches, cur, total, epoch = [], [], 0, 0
    while len(batches) < count:
        for i in np.random.default_rng(seed + epoch).permutation(len(lengths)):
            s = int(lengths[i])
            if total + s > tokens and cur:
                batches.append(cur)
                if len(batches) == count:
                    return batches
                cur, total = [], 0
            cur.append(int(i))
            total += s
        epoch += 1
    return batches
