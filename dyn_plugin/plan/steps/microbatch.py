"""DynaPipe's micro-batching: cut a global batch into variable-size micro-batches by dynamic programming.

Samples are ordered longest first and the order is cut into contiguous runs, one run per
micro-batch. A run's time t(i, j) is the forward+backward time of its slowest pipeline stage,
with the cheapest recompute mode whose memory fits; runs that fit in no mode are infeasible,
and since memory only grows as a run grows, a run's feasible ends form a window. For each
candidate bound t_max on the longest micro-batch,

    f(n, k) = min over i with t(i, n) <= t_max of f(i, k - 1 mod dp) + t(i, n)

gives the least total time to cover the first n samples with a number of micro-batches
congruent to k mod dp (every data-parallel rank must get the same number: ZeRO-2/3 reduce
gradients on every backward). The plan minimises (stages - 1) * t_max + f(N, 0) / dp: pipeline
fill and drain plus the work spread over the replicas.

Unlike the seed, every cost comes from the cost table in a flat loop (csrc/microbatch.hpp does
the same in C++ on the same tables), and the t_max candidates are the run times themselves,
thinned geometrically and pruned once no larger bound can win.

With sequence parallelism every micro-batch of the partition is split over the ``sp`` ranks of
its group: a run is priced per rank (``features(..., sp)``) plus, per transformer layer of each
stage, its attention collectives (``LayerComm``: a + b * token slots per rank), as
``pricing.make_micro_batch`` prices the micro-batch it becomes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...cost.model import Features, Layout, Recompute, StageSpec, round_up
from ...cost.native import core
from ...cost.sequence_parallel import LayerComm
from ...cost.table import TableCostModel, evaluate_stage

THIN = 0.02  # keep a t_max candidate only if it is 2% above the last kept one


@dataclass(frozen=True)
class Partition:
    """Runs [bounds[m], bounds[m+1]) of the longest-first order, and each run's recompute mode."""

    order: tuple[int, ...]  # sample indices, longest first
    bounds: tuple[int, ...]
    recompute: tuple[str, ...]
    layout: Layout
    t_max: float
    objective: float


class InfeasibleError(ValueError):
    """A sample that fits in no micro-batch, even alone and with full recompute."""


@dataclass(frozen=True)
class StageMemory:
    """What one pipeline stage can hold: ``budget`` bytes for activations, and how many
    micro-batches keep theirs alive at once under 1F1B (stages - stage index). ``states``: the
    model states the device holds beside them (what was taken off its memory to leave the budget)."""

    budget: float
    in_flight: int
    states: float = 0.0

    def fits(self, stored: float, peak: float) -> bool:
        """Every micro-batch in flight keeps as much as this one, plus this one's transient."""
        return self.in_flight * stored + (peak - stored) <= self.budget


def run_features(
    count: int, total: int, square: int, longest: int, layout: Layout, pad_multiple: int, sp: int = 1
) -> Features:
    """``features(lens, layout, pad_multiple, sp)`` of a run of ``count`` sequences from its running
    sums (tokens ``total``, squares ``square``): the twin of ``CostTable::from_sums`` in
    csrc/cost_table.hpp, integer sums converted once, so both compute the same doubles."""
    if layout == "packed":
        width = round_up(total, sp)
        fill = width - total  # the padding document, a causal block of its own
        return Features(float(width) / sp, float(square + fill * fill) / sp, longest)
    width = round_up(round_up(longest, pad_multiple), sp)
    return Features(float(count * width) / sp, float(count * width * width) / sp, width)


def run_costs(
    lens: np.ndarray,
    cost: TableCostModel,
    layout: Layout,
    recomputes: Sequence[Recompute],
    stages: Sequence[StageSpec],
    memory: Sequence[StageMemory],
    tp: int = 1,
    sp: int = 1,
    comm: Sequence[LayerComm] | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """For each start i: times and mode indices of runs [i, i+1), [i, i+2), ... while feasible,
    per rank of a sequence-parallel group of ``sp``; ``comm[m]``: each layer's collectives under
    ``recomputes[m]`` (None: none priced).

    Pure-Python twin of ``run_costs`` in csrc/microbatch.hpp.
    """
    tables = [cost.table(layout, r, tp) for r in recomputes]
    per_layer = None if comm is None else [c.as_tuple() for c in comm]
    times, modes = [], []
    n = len(lens)
    for i in range(n):
        ts, ms = [], []
        total = square = longest = 0
        for j in range(i + 1, n + 1):
            # running sums, as the C++ twin keeps them
            s = int(lens[j - 1])
            total, square, longest = total + s, square + s * s, max(longest, s)
            f = run_features(j - i, total, square, longest, layout, cost.pad_multiple, sp)
            best, best_mode = np.inf, -1
            for mi, table in enumerate(tables):
                if not (cost.allow_extrapolation or table.covers(f.slots, f.max_len)):
                    continue
                t, fits = 0.0, True
                for spec, mem in zip(stages, memory):
                    c = evaluate_stage(table, f, spec)
                    stored, peak = c.stored_bytes, c.peak_bytes
                    if per_layer is not None:
                        fa, fb, ba, bb, kept_slot, kept_pair, live, live_slot, live_pair = per_layer[mi]
                        kept = spec.num_layers * (kept_slot * f.slots + kept_pair * f.attn)
                        stored, peak = stored + kept, peak + kept + (live + live_slot * f.slots + live_pair * f.attn)
                    if not mem.fits(stored, peak):
                        fits = False
                        break
                    fwd, bwd = c.forward_ms, c.backward_ms
                    if per_layer is not None:
                        fwd += spec.num_layers * (fa + fb * f.slots)
                        bwd += spec.num_layers * (ba + bb * f.slots)
                    t = max(t, fwd + bwd)
                if fits and t < best:
                    best, best_mode = t, mi
            if best_mode < 0:
                break  # memory only grows with the run: no longer run fits either
            ts.append(best)
            ms.append(best_mode)
        times.append(np.array(ts))
        modes.append(np.array(ms, dtype=np.int64))
    return times, modes


def candidates(times: list[np.ndarray]) -> np.ndarray:
    """t_max candidates: run times at or above the largest single-sample time, thinned geometrically."""
    lower = max(t[0] for t in times)
    values = np.unique(np.concatenate(times))
    values = values[values >= lower]
    kept = []
    for v in values:
        if not kept or v >= kept[-1] * (1 + THIN):
            kept.append(v)
    if kept[-1] != values[-1]:
        kept.append(values[-1])  # unbounded: the largest run time allowed
    return np.array(kept)


def partition_dp(times: list[np.ndarray], t_max: float, dp: int) -> tuple[float, list[int]] | None:
    """Least total time with a micro-batch count divisible by dp, runs no longer than t_max."""
    n = len(times)
    f = np.full((n + 1, dp), np.inf)
    back = np.full((n + 1, dp), -1, dtype=np.int64)
    f[0, 0] = 0.0
    came_from = np.array([(k - 1) % dp for k in range(dp)])  # a run moves count class k - 1 to k
    for i in range(n):
        ts = times[i]
        over = ts > t_max
        m = int(np.argmax(over)) if over.any() else len(ts)  # run times grow with length: stop at the first over
        if m == 0 or f[i].min() == np.inf:
            continue
        # runs [i, i + w + 1) for w < m, into every count class at once
        v = f[i][came_from][:, None] + ts[None, :m]
        seg, seg_back = f[i + 1 : i + 1 + m].T, back[i + 1 : i + 1 + m].T  # views: writes land in f and back
        better = v < seg
        seg[better] = v[better]
        seg_back[better] = i
    if f[n, 0] == np.inf:
        return None
    bounds, j, k = [n], n, 0
    while j > 0:
        i = int(back[j, k])
        bounds.append(i)
        j, k = i, (k - 1) % dp
    return float(f[n, 0]), bounds[::-1]


def best_bound(times: list[np.ndarray], pp: int, dp: int) -> tuple[float, float, list[int]] | None:
    """(objective, t_max, bounds) of the best partition over the t_max candidates; None if no
    bound gives a micro-batch count divisible by dp."""
    best = None
    floor_total = partition_dp(times, np.inf, dp)
    for t_max in candidates(times):
        # No larger bound can beat the best: its bubble term alone is already too big.
        if best is not None and floor_total is not None and (pp - 1) * t_max + floor_total[0] / dp >= best[0]:
            break
        res = partition_dp(times, t_max, dp)
        if res is None:
            continue
        obj = (pp - 1) * t_max + res[0] / dp
        if best is None or obj < best[0]:
            best = (obj, t_max, res[1])
    return best


def partition(
    lens: Sequence[int],
    cost: TableCostModel,
    *,
    layout: Layout,
    stages: Sequence[StageSpec],
    memory: Sequence[StageMemory],
    dp: int = 1,
    recomputes: Sequence[Recompute] = ("none", "selective", "full"),
    tp: int = 1,
    native: bool = True,
    sp: int = 1,
    comm: Sequence[LayerComm] | None = None,
) -> Partition:
    """The DP over the longest-first order (C++ when built and ``native``; same result either way).

    ``sp``: every micro-batch runs on a sequence-parallel group of that many ranks, priced per rank;
    ``comm``: one ``LayerComm`` per entry of ``recomputes`` (``PlannerSpec.layer_comm(sp, mode)``),
    each layer's attention collectives in that mode; None prices none (as for ``sp`` = 1)."""
    arr = np.asarray(lens, dtype=np.int64)
    if arr.ndim != 1 or len(arr) == 0:
        raise ValueError("a global batch needs at least one sequence")
    if len(arr) < dp:
        raise ValueError(
            f"a global batch of {len(arr)} sequences cannot give each of {dp} data-parallel ranks a micro-batch"
        )
    if sp < 1 or sp & (sp - 1):
        raise ValueError(f"a sequence-parallel size must be a power of two, got sp={sp}")
    if comm is not None and len(comm) != len(recomputes):
        raise ValueError(
            f"comm has {len(comm)} entries; it needs one LayerComm per recompute mode "
            f"({len(recomputes)}: {', '.join(recomputes)})"
        )
    order = np.argsort(-arr, kind="stable")
    sorted_lens = arr[order]
    pp = len(stages)
    if native and core is not None:
        tables = [cost.native(layout, r, tp) for r in recomputes]
        specs = [(s.num_layers, s.first, s.last) for s in stages]
        mems = [(m.budget, m.in_flight) for m in memory]
        per_layer = [] if comm is None else [c.as_tuple() for c in comm]
        ok, bounds, modes, t_max, obj, bad = core.partition(sorted_lens, tables, specs, mems, dp, THIN, sp, per_layer)
        if not ok and bad >= 0:
            _infeasible(arr, order, bad, layout, memory)
        if not ok:
            _no_even_split(len(arr), dp)
        return Partition(
            tuple(int(x) for x in order), tuple(bounds), tuple(recomputes[m] for m in modes), layout, t_max, obj
        )
    times, modes = run_costs(sorted_lens, cost, layout, recomputes, stages, memory, tp, sp, comm)
    for i, t in enumerate(times):
        if len(t) == 0:
            _infeasible(arr, order, i, layout, memory)
    best = best_bound(times, pp, dp)
    if best is None:
        _no_even_split(len(arr), dp)
    obj, t_max, bounds = best
    run_modes = [recomputes[int(modes[a][b - a - 1])] for a, b in zip(bounds, bounds[1:])]
    return Partition(tuple(int(x) for x in order), tuple(bounds), tuple(run_modes), layout, float(t_max), float(obj))


def _no_even_split(n: int, dp: int):
    raise InfeasibleError(
        f"no way to cut {n} sequences into a multiple of {dp} micro-batches that fit: every replica needs the "
        "same number, and the sequences that would have to share a micro-batch do not fit together (in memory, "
        "or in the range the cost model measured); profile larger micro-batches or change the token budget"
    )


def _infeasible(arr, order, pos: int, layout: Layout, memory: Sequence[StageMemory]):
    idx = int(order[pos])
    budget = min(m.budget for m in memory)
    raise InfeasibleError(
        f"sequence {idx} (length {int(arr[idx])}) does not fit in a {layout} micro-batch on its own, even with "
        f"full recompute: activation memory per stage is limited to {budget / 2**20:.0f} MiB after model states "
        "(or it is longer than the cost model measured); raise cluster.device.memory_mb, add pipeline stages, "
        "or cap microbatching.max_seq_len"
    )
