"""Data-parallel assignment: micro-batches to replicas, balanced, the same count on each.

Equal counts are not a nicety: ZeRO-2/3 reduce gradients on every backward, so a replica with
one micro-batch more waits forever for the others. Within that constraint the replicas'
total times are balanced (longest-processing-time first onto the least-loaded replica that
still has room), then improved by pairwise swaps between the heaviest and lightest replica.
"""

from __future__ import annotations

from typing import Sequence


def assign_to_replicas(times: Sequence[float], dp: int) -> list[list[int]]:
    """Indices of ``times`` per replica; each replica gets len(times) / dp of them."""
    m = len(times)
    if dp < 1 or m % dp:
        raise ValueError(f"{m} micro-batches cannot be split evenly over {dp} data-parallel replicas")
    per = m // dp
    groups: list[list[int]] = [[] for _ in range(dp)]
    load = [0.0] * dp
    for i in sorted(range(m), key=lambda i: (-times[i], i)):
        r = min((r for r in range(dp) if len(groups[r]) < per), key=lambda r: (load[r], r))
        groups[r].append(i)
        load[r] += times[i]
    _improve_by_swaps(groups, load, times)
    return [sorted(g) for g in groups]


def _improve_by_swaps(groups: list[list[int]], load: list[float], times: Sequence[float], rounds: int = 32) -> None:
    for _ in range(rounds):
        hi = max(range(len(load)), key=lambda r: (load[r], -r))
        lo = min(range(len(load)), key=lambda r: (load[r], r))
        gap = load[hi] - load[lo]
        best, pair = 0.0, None
        for a in groups[hi]:
            for b in groups[lo]:
                d = times[a] - times[b]
                # moving d from hi to lo shrinks the gap to |gap - 2d|
                gain = gap - abs(gap - 2 * d)
                if gain > best + 1e-12:
                    best, pair = gain, (a, b)
        if pair is None:
            return
        a, b = pair
        groups[hi][groups[hi].index(a)] = b
        groups[lo][groups[lo].index(b)] = a
        d = times[a] - times[b]
        load[hi] -= d
        load[lo] += d


def split_for_replicas(
    groups: Sequence[Sequence[int]], lengths: Sequence[int], dp: int, *, equal_counts: bool
) -> list[list[int]]:
    """Split the groups holding the most tokens in two (alternate members) until every one of ``dp``
    replicas can get a group, and with ``equal_counts`` until the count divides by ``dp``.

    A host framework's sampler gives each rank its own sequences, so no rank sits a step out;
    ZeRO-2/3 also need equal counts. Raises ValueError when only single-sequence groups are left.
    """
    out = [list(g) for g in groups]
    while len(out) < dp or (equal_counts and len(out) % dp):
        big = max((g for g in out if len(g) > 1), key=lambda g: (sum(lengths[i] for i in g), -g[0]), default=None)
        if big is None:
            need = f"a multiple of {dp}" if equal_counts else f"at least {dp}"
            raise ValueError(
                f"{sum(map(len, out))} sequences cannot be cut into {need} micro-batches "
                f"for {dp} data-parallel replicas"
            )
        out.remove(big)
        out += [big[0::2], big[1::2]]
    return out
