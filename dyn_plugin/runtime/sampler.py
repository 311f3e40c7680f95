"""Global batches by token budget: the unit every plan is made for.

An epoch is a seeded shuffle of all samples (seed + epoch, so every rank derives the same
order without talking) cut into consecutive global batches of whole sequences up to the token
budget. Every sample lands in exactly one batch of the epoch; a short tail with fewer
sequences than ``min_sequences`` (one per data-parallel replica) joins the batch before it
rather than being dropped.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def epoch_batches(lengths: Sequence[int], tokens: int, *, seed: int, epoch: int, min_sequences: int = 1) -> list[list[int]]:
    """Sample indices of every global batch of one epoch, in order."""
    lengths = np.asarray(lengths)
    if tokens <= 0:
        raise ValueError(f"the global batch token budget must be positive, got {tokens}")
    if len(lengths) < min_sequences:
        raise ValueError(f"{len(lengths)} samples cannot fill a global batch of at least {min_sequences} sequences")
    batches: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i in np.random.default_rng(seed + epoch).permutation(len(lengths)):
        s = int(lengths[i])
        if total + s > tokens and len(cur) >= min_sequences:
            batches.append(cur)
            cur, total = [], 0
        cur.append(int(i))
        total += s
    if len(cur) < min_sequences and batches:
        batches[-1] += cur
    else:
        batches.append(cur)
    return batches


def global_batches(lengths: Sequence[int], tokens: int, count: int, seed: int) -> list[list[int]]:
    """The first ``count`` global batches, epoch after epoch (for planning and benchmarks)."""
    if count <= 0:
        raise ValueError(f"need a positive batch count, got {count}")
    out: list[list[int]] = []
    epoch = 0
    while len(out) < count:
        out += epoch_batches(lengths, tokens, seed=seed, epoch=epoch)
        epoch += 1
    return out[:count]
