"""Global batches by token budget: the unit every plan is made for.

An epoch is a seeded shuffle of all samples (seed + epoch, so every rank derives the same
order without talking) cut into consecutive global batches of whole sequences up to the token
budget. Every sample lands in exactly one batch of the epoch; a short tail with fewer
sequences than ``min_sequences`` (one per data-parallel replica) joins the batch before it
rather than being dropped. (input, target) pairs (lengths of shape [N, 2]) count both sides
against the budget: a pair's tokens are its input's and its target's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..checks import MAX_TOKENS, check_count


def epoch_batches(
    lengths: Sequence[int], tokens: int, *, seed: int, epoch: int, min_sequences: int = 1, lookahead: int = 0
) -> list[list[int]]:
    """Sample indices of every global batch of one epoch, in order.

    A batch takes sequences in shuffled order while they fit the budget, and at least
    ``min_sequences`` of them whatever their size. With ``lookahead`` 0 it ends at the first that
    does not fit: lengths are non-negative, so the running sum is monotone and one
    ``searchsorted`` over its prefix sums finds, for every start, where a batch starting there
    would end; the Python loop then runs once per batch, not per sample (1M samples:
    milliseconds, not a second). A batch of long documents then leaves much of its budget empty
    (about 15% with code up to a quarter of the budget). With ``lookahead`` N it goes on past
    those that do not fit, taking any that does, until N have not: the ones passed over are
    deferred to the next batches, in their order, never dropped or repeated (``_filled``).
    """
    lengths = budget_tokens(lengths)
    if tokens <= 0:
        raise ValueError(f"the global batch token budget must be positive, got {tokens}")
    if len(lengths) < min_sequences:
        raise ValueError(f"{len(lengths)} samples cannot fill a global batch of at least {min_sequences} sequences")
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"lengths must be non-negative, got {int(lengths.min())}")
    check_count("lookahead", lookahead, low=0)
    order = np.random.default_rng(seed + epoch).permutation(len(lengths))
    if lookahead:
        return _filled(order, lengths, tokens, min_sequences, lookahead)
    prefix = np.concatenate([[0], np.cumsum(lengths[order], dtype=np.int64)])
    n = len(order)
    # fits[a]: the end (exclusive) of the longest run from a whose tokens stay within the budget
    fits = np.searchsorted(prefix, prefix[:-1] + tokens, side="right") - 1
    ids = order.tolist()
    batches: list[list[int]] = []
    start = 0
    while True:
        end = max(start + min_sequences, int(fits[start]))
        if end >= n:
            break
        batches.append(ids[start:end])
        start = end
    if n - start < min_sequences and batches:  # a short tail joins the batch before it
        batches[-1] += ids[start:]
    else:
        batches.append(ids[start:])
    return batches


def _filled(order: np.ndarray, lengths: np.ndarray, tokens: int, min_sequences: int, lookahead: int) -> list[list[int]]:
    """``epoch_batches`` with a lookahead: each batch takes, in the epoch's order, every sequence not
    taken yet that fits what is left of the budget (the first ``min_sequences`` whatever their
    size), and stops once ``lookahead`` have not fitted. A plain loop over positions (each batch
    starts at the first not taken), so every sample is in exactly one batch."""
    lens = lengths[order].tolist()
    ids = order.tolist()
    n = len(ids)
    taken = bytearray(n)
    batches: list[list[int]] = []
    head = 0  # the first position not taken yet
    while head < n:
        batch: list[int] = []
        room, missed, i = tokens, 0, head
        while i < n and missed <= lookahead and (room > 0 or len(batch) < min_sequences):
            if not taken[i]:
                if lens[i] <= room or len(batch) < min_sequences:
                    taken[i] = 1
                    batch.append(ids[i])
                    room -= lens[i]
                else:
                    missed += 1
            i += 1
        batches.append(batch)
        while head < n and taken[head]:
            head += 1
    if len(batches) > 1 and len(batches[-1]) < min_sequences:  # a short tail joins the batch before it
        tail = batches.pop()
        batches[-1] += tail
    return batches


def budget_tokens(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """Each sample's tokens against the global batch budget: its length, or input + target of a pair."""
    lengths = np.asarray(lengths)
    if lengths.ndim == 2 and lengths.shape[1] == 2:
        return lengths.sum(axis=1)
    if lengths.ndim != 1:
        raise ValueError(
            f"lengths must be one token count per sample or an [N, 2] array of (input, target) pairs, "
            f"got shape {list(lengths.shape)}"
        )
    return lengths


def global_batches(lengths: Sequence[int], tokens: int, count: int, seed: int) -> list[list[int]]:
    """The first ``count`` global batches, epoch after epoch (for planning and benchmarks)."""
    check_count("count", count)
    check_count("tokens", tokens, high=MAX_TOKENS)
    out: list[list[int]] = []
    epoch = 0
    while len(out) < count:
        out += epoch_batches(lengths, tokens, seed=seed, epoch=epoch)
        epoch += 1
    return out[:count]
