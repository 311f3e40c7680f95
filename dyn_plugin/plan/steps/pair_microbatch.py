"""DynaPipe's micro-batching for (input, target) pairs: order the pairs, cut contiguous runs by DP.

A run becomes one micro-batch padded to its longest input and longest target. DynaPipe orders
encoder-decoder samples along a short path through the (input, target) points (a TSP over
clustered points, 3-6% better than plain sorting in its paper); without it, it sorts by input
length, then target length, longest first. Here both sorts are tried, input-major and
target-major, and the cheaper partition is kept: a batch whose targets vary more than its inputs
groups better the second way.

A run's time t(i, j) is its slowest stage's forward + backward (encoder and decoder stages alike)
in the cheapest recompute mode in which every stage holds it with 1F1B's in-flight count
(``StageMemory.fits``) inside the measured range; the DP over t_max candidates, the equal
micro-batch count per data-parallel replica and the objective (stages - 1) * t_max + sum / dp are
``microbatch.best_bound`` unchanged: only the run costs differ.
Run costs are computed for all runs at once with numpy, windows doubling while runs still fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...cost.model import Recompute, round_up
from .microbatch import InfeasibleError, best_bound
from .pair_spec import PairSpec
from .types import PairMicroBatch

ORDERS = ("input", "target")


@dataclass(frozen=True)
class PairPartition:
    """Runs [bounds[m], bounds[m+1]) of ``order`` (pair indices), each run's recompute mode."""

    order: tuple[int, ...]
    bounds: tuple[int, ...]
    recompute: tuple[str, ...]
    by: str  # which sort: "input" (then target) or "target" (then input)
    t_max: float
    objective: float

    def groups(self) -> list[tuple[int, ...]]:
        return [self.order[a:b] for a, b in zip(self.bounds, self.bounds[1:])]


def check_pairs(inputs: Sequence[int], targets: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    enc, dec = np.asarray(inputs, dtype=np.int64), np.asarray(targets, dtype=np.int64)
    if enc.ndim != 1 or enc.shape != dec.shape or len(enc) == 0:
        raise ValueError(
            f"a global batch of pairs needs as many input as target lengths, at least one; got {enc.shape} and {dec.shape}"
        )
    if enc.min() <= 0 or dec.min() <= 0:
        raise ValueError("input and target lengths must be positive")
    return enc, dec


def order_pairs(inputs: Sequence[int], targets: Sequence[int], by: str = "input") -> np.ndarray:
    """Pair indices longest first by ``by`` ("input": input length, then target length; "target":
    the reverse), ties in index order: every rank derives the same order."""
    enc, dec = check_pairs(inputs, targets)
    if by not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}; got {by!r}")
    major, minor = (enc, dec) if by == "input" else (dec, enc)
    return np.lexsort((np.arange(len(enc)), -minor, -major))


def run_costs(
    enc: np.ndarray, dec: np.ndarray, spec: PairSpec, block: int = 32
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """For each start i of the ordered pairs: times and recompute-mode indices of runs [i, i+1),
    [i, i+2), ... while one fits (memory only grows as a run grows, so its feasible ends are a
    prefix). Priced ``block`` run lengths at a time, only for starts whose runs still fit."""
    n_all = len(enc)
    pm = spec.cost.pad_multiple
    e = np.array([round_up(int(x), pm) for x in enc], dtype=float)
    d = np.array([round_up(int(x), pm) for x in dec], dtype=float)
    times: list[list[np.ndarray]] = [[] for _ in range(n_all)]  # per start, per block: its runs' times
    modes: list[list[np.ndarray]] = [[] for _ in range(n_all)]
    rows = np.arange(n_all)
    se_run, sd_run = np.zeros(n_all), np.zeros(n_all)  # running maxima up to the last priced length
    for first in range(0, n_all, block):
        rows = rows[rows + first < n_all]
        if len(rows) == 0:
            break
        width = np.arange(first, min(first + block, n_all))
        idx = rows[:, None] + width[None, :]
        valid = idx < n_all
        at = np.minimum(idx, n_all - 1)
        se = np.maximum.accumulate(np.maximum(np.where(valid, e[at], 0.0), se_run[rows, None]), axis=1)
        sd = np.maximum.accumulate(np.maximum(np.where(valid, d[at], 0.0), sd_run[rows, None]), axis=1)
        n = np.broadcast_to(width + 1.0, se.shape)
        best, mode = _price_runs(n, se, sd, valid, spec)
        fits = mode >= 0
        # a start's runs end at its first run that fits in no mode (memory only grows with the run)
        ends = np.where(fits.all(axis=1), fits.shape[1], np.argmin(fits, axis=1))
        for r, i in enumerate(rows.tolist()):
            times[i].append(best[r, : ends[r]])
            modes[i].append(mode[r, : ends[r]])
        se_run[rows], sd_run[rows] = se[:, -1], sd[:, -1]
        rows = rows[ends == fits.shape[1]]  # the others' runs stopped fitting inside this block
    return [np.concatenate(t) for t in times], [np.concatenate(m) for m in modes]


def _price_runs(n, se, sd, valid, spec: PairSpec) -> tuple[np.ndarray, np.ndarray]:
    """Per run (arrays of pairs, padded input and target lengths): the time in its cheapest
    recompute mode that fits every stage, and that mode's index; inf and -1 where none does."""
    best = np.full(se.shape, np.inf)
    mode = np.full(se.shape, -1, dtype=np.int64)
    for mi, rc in enumerate(spec.recomputes):
        ok = valid & spec.cost.table(rc, spec.tp).covers(n, se, sd)
        t = np.zeros(se.shape)
        memo: dict = {}  # each side's layer and the head evaluated once for every stage
        for stage, mem in zip(spec.stages, spec.memory):
            fwd, bwd, stored, peak = spec.cost.stage_costs(stage, n, se, sd, recompute=rc, tp=spec.tp, memo=memo)
            ok &= mem.in_flight * stored + (peak - stored) <= mem.budget
            t = np.maximum(t, fwd + bwd)
        better = ok & (t < best)
        best = np.where(better, t, best)
        mode = np.where(better, mi, mode)
    return best, mode


def partition_pairs(
    inputs: Sequence[int], targets: Sequence[int], spec: PairSpec, *, orders: Sequence[str] = ORDERS
) -> PairPartition:
    """The DP over each order in ``orders``; the partition with the smallest objective."""
    enc, dec = check_pairs(inputs, targets)
    if len(enc) < spec.dp:
        raise ValueError(
            f"a global batch of {len(enc)} pairs cannot give each of {spec.dp} data-parallel ranks a micro-batch"
        )
    best: PairPartition | None = None
    for by in orders:
        order = order_pairs(enc, dec, by)
        times, modes = run_costs(enc[order], dec[order], spec)
        for pos, t in enumerate(times):
            if len(t) == 0:
                i = int(order[pos])
                raise InfeasibleError(
                    f"pair {i} (input {int(enc[i])}, target {int(dec[i])}) fits in no micro-batch on its own, even "
                    f"with {spec.recomputes[-1]} recompute: activation memory per stage is limited to "
                    f"{min(m.budget for m in spec.memory) / 2**20:.0f} MiB after model states, or it is longer than "
                    "the cost model measured; raise the device memory or tp, add pipeline stages, or cap the lengths"
                )
        found = best_bound(times, spec.pp, spec.dp)
        if found is None:
            continue
        objective, t_max, bounds = found
        if best is None or objective < best.objective:
            rc = tuple(spec.recomputes[int(modes[a][b - a - 1])] for a, b in zip(bounds, bounds[1:]))
            best = PairPartition(tuple(int(i) for i in order), tuple(bounds), rc, by, float(t_max), float(objective))
    if best is None:
        raise InfeasibleError(
            f"no way to cut {len(enc)} pairs into a multiple of {spec.dp} micro-batches that fit: every replica "
            "needs the same number; raise the memory or plan more pairs per step"
        )
    return best


def make_pair_micro_batch(
    sample_ids: Sequence[int],
    inputs: Sequence[int],
    targets: Sequence[int],
    *,
    spec: PairSpec,
    recompute: Recompute,
    padded_to: tuple[int, int] | None = None,
    rows: int | None = None,
) -> PairMicroBatch:
    """Price one micro-batch of pairs on every stage (:func:`price_pair_groups` of one group)."""
    return price_pair_groups(
        [sample_ids], inputs, targets, [recompute], spec=spec, padded_to=padded_to, rows=rows and [rows]
    )[0]


def price_pair_groups(
    groups: Sequence[Sequence[int]],
    inputs: Sequence[int],
    targets: Sequence[int],
    recomputes: Sequence[Recompute],
    *,
    spec: PairSpec,
    padded_to: tuple[int, int] | None = None,
    rows: Sequence[int] | None = None,
) -> list[PairMicroBatch]:
    """Price micro-batches of pairs (``groups`` of pair ids, ``recomputes[g]`` each) on every stage,
    all at once. ``padded_to``: (input, target) widths every row is padded to (fixed padding,
    fixed-length rows); default each micro-batch's longest pair, rounded up to the pad multiple.
    ``rows[g]``: group g's pairs packed into that many rows of ``padded_to`` (layout "packed", each
    row a whole-row attention block, as fixed-length packing runs: ``packed_pair_shape``); default
    one row a pair. ``extrapolated``: outside the measured range."""
    cost, pm = spec.cost, spec.cost.pad_multiple
    ins = [tuple(int(inputs[i]) for i in g) for g in groups]
    tgs = [tuple(int(targets[i]) for i in g) for g in groups]
    if any(not g for g in groups) or len(recomputes) != len(groups):
        raise ValueError("every micro-batch needs at least one pair and a recompute mode")
    if padded_to is not None and (padded_to[0] < max(map(max, ins)) or padded_to[1] < max(map(max, tgs))):
        raise ValueError(f"padded_to={padded_to} is shorter than a micro-batch's longest pair")
    if rows is not None and (
        padded_to is None
        or len(rows) != len(groups)
        or any(r < 1 or r * padded_to[0] < sum(a) or r * padded_to[1] < sum(b) for r, a, b in zip(rows, ins, tgs))
    ):
        raise ValueError(f"rows={rows}: the pairs do not fit that many rows of {padded_to}")
    n = np.array([len(a) for a in ins] if rows is None else list(rows), dtype=float)
    if padded_to is None:
        se = np.array([round_up(max(a), pm) for a in ins], dtype=float)
        sd = np.array([round_up(max(b), pm) for b in tgs], dtype=float)
    else:
        se, sd = np.full(len(n), float(padded_to[0])), np.full(len(n), float(padded_to[1]))
    out: list[np.ndarray] = [np.zeros((len(n), spec.pp)) for _ in range(4)]  # fwd, bwd, stored, peak
    covered = np.zeros(len(n), dtype=bool)
    modes = np.array(recomputes)
    for rc in dict.fromkeys(recomputes):
        at = modes == rc
        covered[at] = cost.table(rc, spec.tp).covers(n[at], se[at], sd[at])
        memo: dict = {}
        for s, stage in enumerate(spec.stages):
            for metric, values in zip(
                out, cost.stage_costs(stage, n[at], se[at], sd[at], recompute=rc, tp=spec.tp, memo=memo)
            ):
                metric[at, s] = values
    links = [
        [cost.link_bytes(stage, int(n[g]), int(se[g]), int(sd[g]), spec.tp) for stage in spec.stages[:-1]]
        for g in range(len(n))
    ]
    # a split backward's W and what it holds, per stage (zero-bubble schedules only)
    split = [
        cost.split_backward_costs(stage, n, se, sd, out[1][:, s], tp=spec.tp) if spec.split_backward else None
        for s, stage in enumerate(spec.stages)
    ]
    for s, k in enumerate(spec.stage_time):  # the online calibration's stage factors, W (at most B) with them
        out[0][:, s] *= k
        out[1][:, s] *= k
        if split[s] is not None:
            split[s] = (split[s][0] * k, split[s][1])
    priced = all(x is not None for x in split)
    return [
        PairMicroBatch(
            sample_ids=tuple(int(i) for i in g),
            seq_lens=ins[k],
            layout="padded" if rows is None else "packed",
            recompute=recomputes[k],
            forward_ms=tuple(out[0][k].tolist()),
            backward_ms=tuple(out[1][k].tolist()),
            stored_bytes=tuple(out[2][k].tolist()),
            peak_bytes=tuple(out[3][k].tolist()),
            activation_bytes=max(links[k], default=0.0),
            shape=(int(n[k]), int(se[k])),
            extrapolated=not bool(covered[k]),
            link_bytes=tuple(links[k]),
            target_lens=tgs[k],
            target_shape=(int(n[k]), int(sd[k])),
            weight_ms=tuple(float(w[k]) for w, _ in split) if priced else (),
            deferred_bytes=tuple(float(h[k]) for _, h in split) if priced else (),
        )
        for k, g in enumerate(groups)
    ]
