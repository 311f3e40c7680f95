"""Hydraulis's stage 1: a step's sequences dispatched to the pipelines of a strategy.

A pipeline of kind t (its scheme) runs sequence i in ``times[t, i]`` ms (inf: it does not fit
there, the kind's capacity); its step takes about ``load + fill[t] * longest``: the sum of its
sequences' times plus the pipeline fill and drain, (pp - 1) times its longest sequence's. The
makespan, the largest pipeline finish, is what the step waits for.

``dispatch``: sequences longest first, each onto the pipeline where it would finish earliest
(LPT with the fill term); where the step is small enough, also the seed's random orders (the
same seeded orders ``seed_dispatch`` tries), so its result is never worse than the seed's; then
local improvement of the best. Pipelines of one kind differ
only in (load, longest), so each kind keeps a heap of its used pipelines by finish and a queue
of its empty ones: the greedy costs O(n kinds log pipelines), not O(n pipelines).
``seed_dispatch``: the seed's rule (random-order greedy, best of 50 trials), the baseline.
csrc/dispatch.hpp is the C++ twin of both: the same choices, ties and moves, the same
floating-point operations in the same order, so the two give bit-identical results.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...cost.native import core
from ..steps.microbatch import InfeasibleError

# Bound on local-improvement rounds (one accepted move or swap each): every accepted round
# lowers the descending-sorted finishes lexicographically, so it stops by itself; the bound only
# caps the time on inputs where many tiny moves each shave a little.
ROUNDS = 256
# A round scores every swap of the busiest pipeline's sequences with every other sequence, about
# n^2 / pipelines pairs: rounds are cut so that all of them together stay near this many pairs
# (10,000 sequences on 80 pipelines: 16 rounds, under 0.1 s in C++), the greedy's cost otherwise.
SWAP_PAIRS = 20_000_000
# Random orders tried beside longest-first, the seed's 50, up to 1,600 sequences (a few ms in
# C++); none beyond, where longest-first alone already wins (1024 GPUs, 11,600 sequences: a 1.5x
# smaller makespan than the seed's best of 50) and each order would cost about 8 ms.
TRIALS = 50
TRIAL_PLACEMENTS = 80_000


@dataclass(frozen=True)
class Dispatch:
    members: tuple[tuple[int, ...], ...]  # per pipeline, sequence indices in the order assigned
    finish_ms: tuple[float, ...]  # per pipeline, load + fill * longest (0 for an empty pipeline)

    @property
    def makespan_ms(self) -> float:
        return max(self.finish_ms, default=0.0)


def dispatch(
    times: np.ndarray,
    kinds: Sequence[int],
    fill: Sequence[float],
    lengths: np.ndarray,
    *,
    improve: bool = True,
    native: bool = True,
    seed: int = 0,
    trials: int | None = None,
) -> Dispatch:
    """Longest first (stable by ``lengths``), each sequence onto the pipeline where it would
    finish earliest; the greedy also in the first ``trials`` (default TRIALS where n * TRIALS <=
    TRIAL_PLACEMENTS, else 0: longest-first alone) of the random orders
    ``seed_dispatch(seed=seed)`` tries, the smallest makespan kept (ties: longest-first, then the
    earliest order); then (``improve``) local improvement of it; see ``_greedy`` and
    ``_improve``.

    ``times``: [kinds, sequences] ms, inf where a sequence does not fit a kind; ``kinds[p]``:
    pipeline p's kind (row of ``times``); ``fill[t]``: kind t's fill and drain factor (pp - 1).
    Pipelines may end up empty. Raises InfeasibleError when a sequence fits no pipeline.
    """
    t, k, f, lens = _checked(times, kinds, fill, lengths)
    best = np.argsort(-lens, kind="stable")
    if trials is None:
        trials = TRIALS if len(lens) * TRIALS <= TRIAL_PLACEMENTS else 0
    if trials:
        rng = np.random.default_rng(seed)
        least = _run(t, k, f, lens, best, 0, native).makespan_ms
        for _ in range(trials):
            order = rng.permutation(len(lens))
            got = _run(t, k, f, lens, order, 0, native).makespan_ms
            if got < least:
                best, least = order, got
    pairs = max(1, len(lens) * len(lens) // len(k))
    rounds = min(ROUNDS, max(1, SWAP_PAIRS // pairs)) if improve else 0
    return _run(t, k, f, lens, best, rounds, native)


def seed_dispatch(
    times: np.ndarray,
    kinds: Sequence[int],
    fill: Sequence[float],
    lengths: np.ndarray,
    *,
    trials: int = 50,
    seed: int = 0,
    native: bool = False,
) -> Dispatch:
    """The seed's stage 1 (Hydraulis), as the baseline: ``trials`` random orders of the
    sequences, each dispatched greedily (every sequence onto the pipeline where it would finish
    earliest, ties to the lowest index), and the order with the smallest makespan kept (ties:
    the earliest trial). No local improvement.

    The seed's text (seeds/003) is its README; its rule is taken from the notes on its code
    (shared/notes/next-wave.md section 3: "50 random shuffles of greedy dispatch", minimising
    the largest pipeline cost). Deviations: its orders come from an unseeded ``random`` and
    here from ``np.random.default_rng(seed)`` (so every rank gets the same result); a pipeline's
    cost is this module's ``load + fill * longest`` with the plugin's per-sequence times instead
    of its fitted a*s^2 + b*s + c, so both rules are judged on one objective; the greedy is this
    module's (the heap per kind), which picks what a scan of every pipeline picks except between
    finishes equal only after rounding. Pure Python by default, as the seed runs; ``native``
    runs the same trials in C++.
    """
    t, k, f, lens = _checked(times, kinds, fill, lengths)
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    rng = np.random.default_rng(seed)
    best = None
    for _ in range(trials):
        got = _run(t, k, f, lens, rng.permutation(len(lens)), 0, native)
        if best is None or got.makespan_ms < best.makespan_ms:
            best = got
    return best


def _checked(times, kinds, fill, lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    t = np.ascontiguousarray(times, dtype=np.float64)
    k = np.ascontiguousarray(kinds, dtype=np.int64)
    f = np.ascontiguousarray(fill, dtype=np.float64)
    lens = np.ascontiguousarray(lengths, dtype=np.int64)
    if t.ndim != 2 or lens.shape != (t.shape[1],) or f.shape != (t.shape[0],) or k.ndim != 1:
        raise ValueError(
            f"times must be [kinds, sequences], lengths [sequences], fill [kinds], kinds [pipelines]; "
            f"got {t.shape}, {lens.shape}, {f.shape}, {k.shape}"
        )
    if len(k) == 0 or ((k < 0) | (k >= len(f))).any():
        raise ValueError(f"need at least one pipeline, each of a kind in [0, {len(f)}); got {k.tolist()}")
    if np.isnan(t).any() or (t < 0).any() or not (np.isfinite(f) & (f >= 0)).all():
        raise ValueError("times must be >= 0 (inf: does not fit) and fill finite and >= 0")
    return t, k, f, lens


def _run(
    times: np.ndarray,
    kinds: np.ndarray,
    fill: np.ndarray,
    lengths: np.ndarray,
    order: np.ndarray,
    rounds: int,
    native: bool,
) -> Dispatch:
    if native and core is not None:
        bad, members, finish = core.dispatch(times, kinds, fill, order, rounds)
    else:
        bad, members, finish = _dispatch(times, kinds, fill, order, rounds)
    if bad >= 0:
        present = np.isfinite(times[np.unique(kinds)]).any(axis=0)
        longest = int(lengths[present].max()) if present.any() else 0
        raise InfeasibleError(
            f"a sequence of {int(lengths[bad])} tokens fits no pipeline of this strategy "
            f"(the longest any pipeline holds here: {longest})"
        )
    return Dispatch(tuple(tuple(m) for m in members), tuple(finish))


def _dispatch(
    times: np.ndarray, kinds: np.ndarray, fill: np.ndarray, order: np.ndarray, rounds: int
) -> tuple[int, list[list[int]], list[float]]:
    """(sequence that fits nowhere or -1, members, finishes): the greedy in ``order``, then up
    to ``rounds`` improvement rounds."""
    state = _greedy(times, kinds.tolist(), fill.tolist(), order.tolist())
    if isinstance(state, int):
        return state, [], []
    load, top1, members = state
    if rounds:
        _improve(times, kinds, fill, load, top1, members, rounds)
    f = fill.tolist()
    return -1, members, [load[p] + f[k] * top1[p] for p, k in enumerate(kinds.tolist())]


def _greedy(
    times: np.ndarray, kinds: list[int], fill: list[float], order: list[int]
) -> tuple[list[float], list[float], list[list[int]]] | int:
    """Each sequence in ``order`` onto the pipeline where it would finish earliest.

    For a sequence of time x on kind t, the kind's candidates are: among its used pipelines
    whose longest is >= x, the least (load + fill * longest, index), finishing at that plus x;
    among its used pipelines whose longest is < x, the least (load, index), finishing at
    (load + fill * x) + x; its empty pipeline of lowest index, finishing at fill * x + x. The
    least (finish, index) over every kind's candidates wins. Longest first, a used pipeline's
    longest is >= x (times grow with length), so the first kind of candidate is the top of the
    kind's heap; otherwise (``floor[t]``, a lower bound on the kind's used longest, is below x)
    the kind's used pipelines are scanned. Returns (load, longest, members), or the first
    sequence that fits no pipeline.
    """
    P, K = len(kinds), len(fill)
    rows = times.tolist()
    load, top1 = [0.0] * P, [0.0] * P
    members: list[list[int]] = [[] for _ in range(P)]
    of_kind = [[p for p in range(P) if kinds[p] == t] for t in range(K)]
    used = [0] * K  # of_kind[t][:used[t]] hold sequences: the empty one of lowest index is always taken first
    heaps: list[list[tuple[float, int, int]]] = [[] for _ in range(K)]  # (load + fill * longest, pipeline, version)
    version = [0] * P
    floor = [math.inf] * K
    for i in order:
        best_f, best_p = math.inf, -1
        for t in range(K):
            x = rows[t][i]
            if not x < math.inf:
                continue
            f = fill[t]
            if x <= floor[t]:
                heap = heaps[t]
                while heap and heap[0][2] != version[heap[0][1]]:
                    heapq.heappop(heap)
                if heap:
                    finish, p = heap[0][0] + x, heap[0][1]
                    if finish < best_f or (finish == best_f and p < best_p):
                        best_f, best_p = finish, p
            else:
                a_key, a_p, b_load, b_p, low = math.inf, -1, math.inf, -1, math.inf
                for p in of_kind[t][: used[t]]:
                    low = min(low, top1[p])
                    if top1[p] >= x:
                        key = load[p] + f * top1[p]
                        if key < a_key:
                            a_key, a_p = key, p
                    elif load[p] < b_load:
                        b_load, b_p = load[p], p
                floor[t] = low
                for finish, p in ((a_key + x, a_p), ((b_load + f * x) + x, b_p)):
                    if p >= 0 and (finish < best_f or (finish == best_f and p < best_p)):
                        best_f, best_p = finish, p
            if used[t] < len(of_kind[t]):
                finish, p = f * x + x, of_kind[t][used[t]]
                if finish < best_f or (finish == best_f and p < best_p):
                    best_f, best_p = finish, p
        if best_p < 0:
            return i
        p = best_p
        t = kinds[p]
        x = rows[t][i]
        if not members[p]:
            used[t] += 1
            floor[t] = min(floor[t], x)
        load[p] += x
        top1[p] = max(top1[p], x)
        members[p].append(i)
        version[p] += 1
        heapq.heappush(heaps[t], (load[p] + fill[t] * top1[p], p, version[p]))
    return load, top1, members


def _second(times: np.ndarray, kind: int, members: list[int]) -> float:
    """The second largest of a pipeline's times (the largest again if it occurs twice; 0 with
    fewer than two sequences)."""
    if len(members) < 2:
        return 0.0
    v = np.sort(times[kind, members])
    return float(v[-2])


def _improve(
    times: np.ndarray,
    kinds: np.ndarray,
    fill: np.ndarray,
    load: list[float],
    top1: list[float],
    members: list[list[int]],
    rounds: int,
) -> None:
    """Local improvement, in place. Each round takes the pipeline s with the largest finish M
    (ties: the lowest index) and, over every sequence j on s, every move of j to another
    pipeline d and every swap of j with a sequence k on another pipeline, the one with the
    least max(new finish of s, new finish of the other pipeline) (ties: moves before swaps,
    then j in s's order, then d or k by index); taken when that is below M, else the search
    stops. A moved sequence is appended to its new pipeline. Loads are updated by the move's
    own subtraction and addition, so the finishes compared are those stored after it.
    """
    n, P = times.shape[1], len(kinds)
    fill_p = fill[kinds]
    ld, hi = np.array(load), np.array(top1)
    lo = np.array([_second(times, kinds[p], members[p]) for p in range(P)])
    owner = np.empty(n, dtype=np.int64)
    for p, m in enumerate(members):
        owner[m] = p
    seq = np.arange(n)
    with np.errstate(invalid="ignore"):  # 0 * inf where a kind has no fill: masked out below
        for _ in range(rounds):
            finish = ld + fill_p * hi
            s = int(np.argmax(finish))
            M = float(finish[s])
            if not members[s]:  # every pipeline is empty
                break
            J = np.array(members[s], dtype=np.int64)
            ts, fs = int(kinds[s]), float(fill[kinds[s]])
            xj = times[ts, J]
            rest_long = np.where(xj == hi[s], lo[s], hi[s])
            rest_load = ld[s] - xj if len(J) > 1 else np.zeros(1)
            # moves: j to d
            y = times[:, J].T[:, kinds]  # [j, d]: j's time on d's kind
            new_d = (ld[None, :] + y) + fill_p[None, :] * np.maximum(hi[None, :], y)
            move = np.maximum((rest_load + fs * rest_long)[:, None], new_d)
            move[:, s] = np.inf
            move[~np.isfinite(y)] = np.inf
            # swaps: j with k
            ko = kinds[owner]
            tk = times[ko, seq]
            without_k = np.where(tk == hi[owner], lo[owner], hi[owner])
            xk = times[ts]
            yj = times[:, J].T[:, ko]  # [j, k]: j's time on k's kind
            new_s = (rest_load[:, None] + xk[None, :]) + fs * np.maximum(rest_long[:, None], xk[None, :])
            new_k = ((ld[owner] - tk)[None, :] + yj) + fill_p[owner][None, :] * np.maximum(without_k[None, :], yj)
            swap = np.maximum(new_s, new_k)
            swap[:, owner == s] = np.inf
            swap[~(np.isfinite(yj) & np.isfinite(xk)[None, :])] = np.inf
            a, b = int(np.argmin(move)), int(np.argmin(swap))
            best = min(float(move.flat[a]), float(swap.flat[b]))
            if not best < M:
                break
            if float(move.flat[a]) <= float(swap.flat[b]):
                j, d = divmod(a, P)
                k = -1
            else:
                j, k = divmod(b, n)
                d = int(owner[k])
            i = int(J[j])
            members[s].remove(i)
            members[d].append(i)
            owner[i] = d
            if k < 0:
                ld[s], hi[s] = rest_load[j], rest_long[j]
                ld[d], hi[d] = ld[d] + y[j, d], max(hi[d], y[j, d])
            else:
                members[d].remove(k)
                members[s].append(k)
                owner[k] = s
                ld[s], hi[s] = rest_load[j] + xk[k], max(rest_long[j], xk[k])
                ld[d], hi[d] = (ld[d] - tk[k]) + yj[j, k], max(without_k[k], yj[j, k])
            lo[s] = _second(times, ts, members[s])
            lo[d] = _second(times, int(kinds[d]), members[d])
    load[:], top1[:] = ld.tolist(), hi.tolist()


__all__ = ["Dispatch", "ROUNDS", "SWAP_PAIRS", "TRIALS", "TRIAL_PLACEMENTS", "dispatch", "seed_dispatch"]
