"""Multiple-choice knapsack: one choice per item, least total time within a memory capacity.

The sharding search (sharding.py) prices every unit of a model under every choice; this picks
one per unit. Memory is in integer units (the caller rounds bytes up, so a solution that fits
in units fits in bytes). One term is not additive: choices that gather parameters on use
("open") need, once, a reserve as large as the largest opened item's (the unit being gathered
while the one before it still computes). With the items in descending reserve order the first
opened item fixes that reserve, so the DP keeps two tables per memory level: N, nothing opened
yet (the reserve not counted), and G, the reserve counted. Items * choices * capacity steps,
vectorised over the capacity in numpy; csrc/knapsack.hpp is the C++ twin (same candidates in
the same order, one addition each, the first least one kept: the lowest choice index, then the
fewest units), used when the extension is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...cost.native import core


@dataclass(frozen=True)
class Knapsack:
    choice: np.ndarray  # [item]: the column chosen
    weight: int  # units used, the reserve included
    frontier: np.ndarray  # [capacity + 1]: least total time within m units (inf: nothing fits)

    @property
    def time(self) -> float:
        return float(self.frontier[-1])


def solve(
    weights: np.ndarray,
    times: np.ndarray,
    capacity: int,
    *,
    opens: np.ndarray | None = None,
    reserve: np.ndarray | None = None,
    native: bool = True,
) -> Knapsack | None:
    """Least sum of ``times[i, c_i]`` with ``sum(weights[i, c_i])`` plus the largest ``reserve[i]``
    of the items whose choice ``opens`` within ``capacity``; None when nothing fits.

    ``weights``: [items, choices] non-negative integers; ``times``: [items, choices], ``inf``
    where a choice is not allowed; ``opens``: [items, choices] bool (default none); ``reserve``:
    [items] non-negative integers (default 0). Same answer with and without the C++ extension.
    """
    w = np.asarray(weights, dtype=np.int64)
    t = np.asarray(times, dtype=np.float64)
    if w.ndim != 2 or t.shape != w.shape:
        raise ValueError(f"weights and times must both be [items, choices]; got {w.shape} and {t.shape}")
    o = np.zeros(w.shape, dtype=bool) if opens is None else np.asarray(opens, dtype=bool)
    e = np.zeros(len(w), dtype=np.int64) if reserve is None else np.asarray(reserve, dtype=np.int64)
    if o.shape != w.shape or e.shape != (len(w),):
        raise ValueError(f"opens must be {w.shape} and reserve ({len(w)},); got {o.shape} and {e.shape}")
    if capacity < 0 or (w < 0).any() or (e < 0).any():
        raise ValueError("capacity, weights and reserve must be non-negative")
    order = np.argsort(-e, kind="stable")  # descending reserve: the first opened item fixes it
    args = (w[order], t[order], o[order], e[order], int(capacity))
    if native and core is not None:
        ok, choice, used, frontier = core.knapsack(args[0], args[1], args[2].astype(np.uint8), args[3], args[4])
    else:
        ok, choice, used, frontier = _solve(*args)
    if not ok:
        return None
    out = np.empty(len(w), dtype=np.int64)
    out[order] = choice
    return Knapsack(out, int(used), np.asarray(frontier))


def _rows(w: np.ndarray, t: np.ndarray, opens: np.ndarray, reserve: int, capacity: int) -> tuple[list, list]:
    """One item's candidates, (choice, shift, fed by N), in the order they are compared: N rows
    (choices that do not open) and G rows (every choice from G; an opening one also from N,
    paying the reserve)."""
    rn, rg = [], []
    for c in range(len(w)):
        if not t[c] < np.inf or w[c] > capacity:
            continue
        if not opens[c]:
            rn.append((c, int(w[c]), True))
        rg.append((c, int(w[c]), False))
        if opens[c] and w[c] + reserve <= capacity:
            rg.append((c, int(w[c] + reserve), True))
    return rn, rg


def _least(rows: list, t: np.ndarray, n: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Per memory level, the least candidate over ``rows``, row by row (csrc/knapsack.hpp's order)."""
    out = np.full(len(n), np.inf)
    for c, shift, from_n in rows:
        v = (n if from_n else g)[: len(n) - shift] + t[c]
        np.minimum(out[shift:], v, out=out[shift:])
    return out


def _solve(w: np.ndarray, t: np.ndarray, opens: np.ndarray, reserve: np.ndarray, capacity: int):
    """The DP over items in descending reserve order: (ok, choice per item, units, frontier)."""
    items = len(w)
    n = np.full((items + 1, capacity + 1), np.inf)  # the tables before each item and after the last
    g = np.full((items + 1, capacity + 1), np.inf)
    n[0, 0] = 0.0
    rows = [_rows(w[i], t[i], opens[i], int(reserve[i]), capacity) for i in range(items)]
    for i, (rn, rg) in enumerate(rows):
        n[i + 1] = _least(rn, t[i], n[i], g[i])
        g[i + 1] = _least(rg, t[i], n[i], g[i])
    best = np.where(n[-1] <= g[-1], n[-1], g[-1])
    frontier = np.minimum.accumulate(best)
    at = int(np.argmin(best))
    if not best[at] < np.inf:
        return False, None, 0, frontier
    choice = np.full(items, -1, dtype=np.int64)
    # back from the last item: the first candidate that gives the table's value is the one kept
    in_g, m = not n[-1, at] <= g[-1, at], at
    for i in range(items - 1, -1, -1):
        value = (g if in_g else n)[i + 1, m]
        for c, shift, from_n in rows[i][1 if in_g else 0]:
            if m >= shift and (n if from_n else g)[i, m - shift] + t[i, c] == value:
                choice[i] = c
                m -= shift
                in_g = in_g and not from_n
                break
    return True, choice, at, frontier


__all__ = ["Knapsack", "solve"]
