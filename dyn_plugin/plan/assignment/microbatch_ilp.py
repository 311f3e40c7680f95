"""Hydraulis's stage 2 as an integer program: one pipeline's sequences cut into micro-batches.

The DynaPipe DP (microbatch.py, the default) only cuts the longest-first order into contiguous
runs; this option lets any sequence join any micro-batch. For one pipeline (a ``PlannerSpec``
with ``sp_sizes = (k,)``, its group size) and the packed layout, with sequences at positions
p of the longest-first order:

- x[p, j] binary: sequence p in micro-batch j < v, each sequence in exactly one;
- z[j, r] binary: micro-batch j runs under recompute mode r (at most one; none when empty);
- S[j, r], Q[j, r] >= 0: its tokens and sum of squared lengths, booked on its mode (zero on the
  others: the memory rows force them to 0 where z = 0), so every cost stays linear without big-M;
- y[j, r, q] >= max(floor * z, c0 z + c1 slots + c2 attn): the cost table's fits that have a
  floor (small kernels stop getting faster), exact for the objective;
- t[j] >= every stage's forward + backward (+ the attention collectives at k > 1) per rank, on
  the per-rank features of ``features(..., sp=k)``: slots = W[j, r] >= S / k, an integer column
  at k > 1 (the tokens rounded up to a multiple of k, over k) and attn = Q / k; the padding
  document's own attention (under k^2 / k pairs) is left out of the time;
- memory per stage and mode: in_flight * stored + transient <= budget (``StageMemory.fits``),
  linear in (z, W, Q) the same way, one row per interval of a banded fit's lengths (activation
  memory is priced per measured length), with that padding attention and the fits' floors added
  on top, so a grouping the program accepts always fits when priced exactly;
- objective: the 1F1B estimate sum_j t_j + (pp - 1) * max_j t_j (M >= t_j), as the DP's.

Symmetry breaking: sequence p may join micro-batch j only if a longer sequence (p' < p) is in
micro-batch j - 1, so micro-batches are numbered by their longest sequence and empty ones come
last; one solve over v = the largest allowed count covers every smaller count, and
``counts`` asks for at least min(counts) non-empty micro-batches.

HiGHS is called through highspy directly rather than through PuLP (the issue names "PuLP and
HiGHS"): PuLP's HiGHS class passes no starting solution and raises KeyError on a node limit
(PuLP 3.3.2), and its model building costs more than the solve at this size; the program is a
few hundred columns built straight into HiGHS's row-wise matrix.

Determinism: one thread, a fixed random seed and a node limit (``mip_max_nodes``) give the same
answer in every process. ``time_limit_s`` adds a wall-clock budget, after which the result may
depend on timing: callers must then solve once and share the result (the plan store, with its
digest) rather than solve on every rank.

The best of the incumbent (the DP's partition, or the one given) and an LPT greedy per count is
handed to HiGHS as its starting solution and returned whenever HiGHS finds nothing better, so
the result is never worse than either on ``pipeline_time_ms`` (exact pricing by
``make_micro_batch``, the planner's own).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import highspy
import numpy as np

from ...cost.model import COMPONENTS
from ...cost.table import LinearFit
from ..steps.microbatch import InfeasibleError, partition
from ..steps.pricing import cheapest_feasible, make_micro_batch, usable
from ..steps.spec import PlannerSpec

logger = logging.getLogger(__name__)

NODE_LIMIT = 100  # branch-and-bound nodes: the deterministic limit
SEED = 0  # HiGHS's random seed, fixed so every process solves alike
REL_GAP = 1e-6  # stop when proved within this fraction of the optimum
TIME_METRICS = ("forward_ms", "backward_ms")
# The starting solution stands in for HiGHS's primal heuristics and the program's own rows break the
# micro-batches' symmetry; strong branching, cuts below the root and restarts each cost more time than
# they save at this size (measured: 3-10x fewer seconds per node budget, no worse objectives).
OPTIONS = {
    "mip_heuristic_run_feasibility_jump": False,
    "mip_heuristic_run_rins": False,
    "mip_heuristic_run_rens": False,
    "mip_heuristic_run_root_reduced_cost": False,
    "mip_detect_symmetry": False,
    "mip_pscost_minreliable": 0,
    "mip_allow_cut_separation_at_nodes": False,
    "mip_allow_restart": False,
}
TOKENS, SQUARES = 1e3, 1e6  # the program counts tokens in thousands and squares in millions: rows of order 1


@dataclass(frozen=True)
class IlpResult:
    """Micro-batches (sequence indices, longest first) and each one's recompute mode;
    ``objective_ms`` and ``incumbent_ms`` are ``pipeline_time_ms`` of the result and of the best
    starting grouping. ``status``: "optimal" (proved, within ``REL_GAP``), "node_limit" or
    "time_limit" (stopped early with a better grouping than the start), "incumbent" (stopped
    early, or infeasible as modelled, with nothing better than the start)."""

    groups: tuple[tuple[int, ...], ...]
    recompute: tuple[str, ...]
    objective_ms: float
    incumbent_ms: float
    status: str
    nodes: int = 0


def pipeline_time_ms(
    groups: Sequence[Sequence[int]], lengths: Sequence[int], spec: PlannerSpec, recompute: Sequence[str] | None = None
) -> float:
    """The 1F1B estimate of one pipeline running ``groups`` as packed micro-batches at its group
    size: sum of the micro-batches' slowest-stage times plus (pp - 1) times the longest one.
    ``recompute``: each group's mode; None takes each group's cheapest mode that fits
    (``cheapest_feasible``). inf where a micro-batch fits no stage's memory."""
    k = _group_size(spec)
    if recompute is None:
        mbs = cheapest_feasible(groups, lengths, spec=spec, layout="packed", sp=k)
        if mbs is None:
            return math.inf
        times = [mb.time_ms for mb in mbs]
    else:
        times = []
        for g, rc in zip(groups, recompute, strict=True):
            mb = make_micro_batch(g, lengths, spec=spec, layout="packed", recompute=rc, sp=k)
            if not usable(mb, spec):
                return math.inf
            times.append(mb.time_ms)
    return sum(times) + (spec.pp - 1) * max(times)


def dp_groups(lengths: Sequence[int], spec: PlannerSpec) -> list[list[int]]:
    """The DynaPipe DP's micro-batches for one pipeline at its group size: the default stage 2."""
    k = _group_size(spec)
    part = partition(
        lengths,
        spec.cost,
        layout="packed",
        stages=spec.stages,
        memory=spec.memory,
        dp=1,
        recomputes=spec.recomputes,
        tp=spec.tp,
        sp=k,
        comm=[spec.layer_comm(k, rc) for rc in spec.recomputes],
    )
    return [list(part.order[a:b]) for a, b in zip(part.bounds, part.bounds[1:])]


class _Model:
    """The cost table's linear pieces per recompute mode, per stage, per rank of a group of k."""

    def __init__(self, spec: PlannerSpec):
        self.k = k = _group_size(spec)
        cost = spec.cost
        self.modes = spec.recomputes
        self.floored: list[list[tuple[float, float, float, float]]] = []  # per mode: (floor, c0, c1, c2)
        self.weight: list[list[list[float]]] = []  # per mode, stage: each floored fit's count on the stage
        self.linear: list[list[tuple[float, float, float]]] = []  # per mode, stage: (z, slots, attn) coefficients
        self.memory: list[list[tuple[float, float, float]]] = []  # per mode: rows (z, tokens, squares) <= 0
        self.max_len: list[float] = []
        comm_fwd = spec.layer_comm(k, "none").forward
        for rc in self.modes:
            table = cost.table("packed", rc, spec.tp)
            fits = table.fits
            floored = [(c, m) for c in COMPONENTS for m in TIME_METRICS if fits[c][m].floor > 0]
            self.floored.append([(fits[c][m].floor, *fits[c][m].coef) for c, m in floored])
            buffers = spec.layer_comm(k, rc)
            comm_bwd = buffers.backward
            weights, linear, memory = [], [], []
            for stage, mem in zip(spec.stages, spec.memory):
                n = {"embedding": int(stage.first), "layer": stage.num_layers, "head": int(stage.last)}
                weights.append([float(n[c]) for c, _ in floored])
                a = np.zeros(3)
                for c in COMPONENTS:
                    for m in TIME_METRICS:
                        if fits[c][m].floor <= 0:
                            a += n[c] * np.array(fits[c][m].coef)
                a += stage.num_layers * np.array([comm_fwd[0] + comm_bwd[0], comm_fwd[1] + comm_bwd[1], 0.0])
                linear.append(tuple(float(v) for v in a))
                # StageMemory.fits: in_flight * stored + max(0, max_c (peak_c - stored_c)) <= budget, one
                # sum of weighted fits per row (a stored_c's weights add up to in_flight * count - 1 >= 0)
                stored = [(fits[c]["stored_bytes"], float(mem.in_flight * n[c])) for c in COMPONENTS if n[c]]
                sums = [stored] + [
                    stored + [(fits[c]["peak_bytes"], 1.0), (fits[c]["stored_bytes"], -1.0)] for c in COMPONENTS if n[c]
                ]
                rows = [r for terms in sums for r in self._rows(terms)]
                # the executor's buffers, linear: kept by every micro-batch in flight, one transient
                extra = np.array(buffers.transient) + mem.in_flight * stage.num_layers * np.array(
                    [0.0, *buffers.stored]
                )
                memory += [
                    (
                        float(r[0] + extra[0]) / mem.budget - 1.0,
                        float(r[1] + extra[1]) / mem.budget,
                        float(r[2] + extra[2]) / mem.budget,
                    )
                    for r in rows
                ]  # over the budget: rows of order 1 for the solver
            if not cost.allow_extrapolation:  # the measured range: slots (with padding) <= max_tokens
                memory.append((-1.0, 1.0 / table.max_tokens, 0.0))
            self.max_len.append(math.inf if cost.allow_extrapolation else table.max_len)
            self.weight.append(weights)
            self.linear.append(linear)
            self.memory.append(memory)

    def _rows(self, terms: list[tuple[LinearFit, float]]) -> list[tuple[float, float, float]]:
        """(z, slots, attn) rows whose largest bounds ``sum(weight * fit)`` from above.

        A banded fit (activation memory) takes its line from the micro-batch's length attn /
        slots, so the sum is one line per interval between the bands' upper lengths (the union
        over the terms) and beyond the last: one row per interval. At any point the row of its
        own interval is the sum exactly, so the largest row is never below it (and equals it when
        the fits are convex in the length, as ``fit_banded`` makes them); the last band's line
        alone would price short micro-batches under their measured memory. Each fit weighted
        up is bounded from above (its floor added, and the padding document's attention, under k
        tokens, a causal block of its own), each weighted down from below (the line alone)."""
        pad = (self.k - 1) ** 2 / self.k
        uppers = sorted({b[0] for fit, _ in terms for b in fit.bands})
        rows = set()
        for length in [*uppers, math.inf]:  # an interval's upper end picks every fit's band there
            row = np.zeros(3)
            for fit, w in terms:
                c0, c1, c2 = fit.coef_at(length)
                extra = max(fit.floor, 0.0) + max(c2, 0.0) * pad if w > 0 else min(c2, 0.0) * pad
                row += w * np.array([c0 + extra, c1, c2])
            rows.add(tuple(float(v) for v in row))
        return sorted(rows)

    def features(self, tokens: int, squares: int) -> tuple[float, float]:
        """Per-rank (slots, attn) as the program has them: the padding document's attention left out."""
        return float(-(-tokens // self.k)), squares / self.k

    def fits(self, r: int, tokens: int, squares: int, longest: int) -> bool:
        slots, attn = self.features(tokens, squares)
        return longest <= self.max_len[r] and all(a + b * slots + c * attn <= 0 for a, b, c in self.memory[r])

    def time(self, r: int, tokens: int, squares: int) -> float:
        """The modelled slowest-stage time."""
        slots, attn = self.features(tokens, squares)
        ys = [max(f, c0 + c1 * slots + c2 * attn) for f, c0, c1, c2 in self.floored[r]]
        return max(
            a + b * slots + c * attn + sum(w * y for w, y in zip(ws, ys))
            for (a, b, c), ws in zip(self.linear[r], self.weight[r])
        )

    def best(self, tokens: float, squares: float, longest: int) -> tuple[float, int]:
        """(time, mode) of the cheapest mode that fits; (inf, -1) if none."""
        best = (math.inf, -1)
        for r in range(len(self.modes)):
            if self.fits(r, tokens, squares, longest):
                best = min(best, (self.time(r, tokens, squares), r))
        return best


def lpt_groups(lengths: Sequence[int], spec: PlannerSpec, count: int) -> list[list[int]] | None:
    """LPT greedy into ``count`` micro-batches: longest first, each sequence onto the micro-batch
    whose modelled time is least after taking it, among those it still fits; None if one fits in
    none (or a micro-batch stays empty)."""
    return _lpt(np.asarray(lengths, dtype=np.int64), _Model(spec), count)


def _lpt(lens: np.ndarray, model: _Model, count: int) -> list[list[int]] | None:
    order = np.argsort(-lens, kind="stable")
    tokens, squares, longest = [0] * count, [0] * count, [0] * count
    groups: list[list[int]] = [[] for _ in range(count)]
    for i in order:
        s = int(lens[i])
        best = (math.inf, -1)
        for j in range(count):
            t, _ = model.best(tokens[j] + s, squares[j] + s * s, max(longest[j], s))
            best = min(best, (t, j))
        if best[1] < 0:
            return None
        j = best[1]
        tokens[j], squares[j], longest[j] = tokens[j] + s, squares[j] + s * s, max(longest[j], s)
        groups[j].append(int(i))
    return groups if all(groups) else None


def ilp_partition(
    lengths: Sequence[int],
    spec: PlannerSpec,
    *,
    incumbent: Sequence[Sequence[int]] | None = None,
    node_limit: int = NODE_LIMIT,
    time_limit_s: float | None = None,
    counts: Sequence[int] | None = None,
) -> IlpResult:
    """The micro-batches of one pipeline's ``lengths`` by the integer program (module docstring).

    ``incumbent``: a grouping to beat (default: ``dp_groups``); ``counts``: the micro-batch counts
    allowed (default: the incumbent's count and one either side). ``node_limit`` is
    the deterministic limit; ``time_limit_s`` a wall-clock one whose results may differ between
    processes (share them through the plan store). Raises InfeasibleError when a sequence fits in
    no micro-batch even alone."""
    lens = np.asarray(lengths, dtype=np.int64)
    n = len(lens)
    if lens.ndim != 1 or n == 0:
        raise ValueError("a pipeline needs at least one sequence")
    if "packed" not in spec.layouts:
        raise ValueError(f"the micro-batch ILP prices the packed layout; the spec allows {spec.layouts}")
    k = _group_size(spec)
    longest = int(np.argmax(lens))
    if cheapest_feasible([[longest]], lens, spec=spec, layout="packed", sp=k) is None:
        budget = min(m.budget for m in spec.memory)
        raise InfeasibleError(
            f"sequence {longest} (length {int(lens[longest])}) does not fit in a packed micro-batch on its own at "
            f"sequence-parallel size {k}, even with full recompute: activation memory per stage is limited to "
            f"{budget / 2**20:.0f} MiB after model states (or it is longer than the cost model measured); use a "
            "larger group, more pipeline stages or more memory, or cap microbatching.max_seq_len"
        )
    if incumbent is None:
        incumbent = dp_groups(lens, spec)
    incumbent = [sorted(int(i) for i in g) for g in incumbent]
    if sorted(i for g in incumbent for i in g) != list(range(n)) or not all(incumbent):
        raise ValueError("the incumbent must hold every sequence exactly once, in non-empty groups")
    if counts is None:
        c = len(incumbent)
        counts = range(max(1, c - 1), min(n, c + 1) + 1)
    allowed = sorted({int(c) for c in counts})
    if not allowed or allowed[0] < 1 or allowed[-1] > n:
        raise ValueError(f"micro-batch counts must lie in 1..{n} (one sequence each at most), got {list(counts)}")
    model = _Model(spec)
    starts = [incumbent] if len(incumbent) in allowed else []
    starts += [g for g in (_lpt(lens, model, c) for c in allowed) if g is not None]
    priced = [(pipeline_time_ms(g, lens, spec), g) for g in starts]
    priced = [p for p in priced if math.isfinite(p[0])]
    start_ms, start = min(priced, key=lambda p: p[0]) if priced else (math.inf, None)
    best_ms, best, statuses, nodes = start_ms, start, [], 0
    deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s
    for lo, hi in _runs(allowed):
        left = None if deadline is None else deadline - time.perf_counter()
        groups, status, used = _solve(
            lens, model, spec.pp, lo, hi, start if start and lo <= len(start) <= hi else None, node_limit, left
        )
        nodes += used
        statuses.append(status)
        if groups is not None:
            ms = pipeline_time_ms(groups, lens, spec)
            if math.isinf(ms):  # the memory rows bound every fit from above: a modelling error, not a limit
                logger.warning(
                    "the micro-batch ILP's grouping %s does not fit when priced exactly; keeping %s", groups, start
                )
            if ms < best_ms:
                best_ms, best = ms, groups
    if best is None:
        raise InfeasibleError(
            f"no grouping of the {n} sequences into {allowed} micro-batches fits in memory; "
            "allow other counts, more stages or more memory"
        )
    improved = best is not start
    if all(s == "optimal" for s in statuses):
        status = "optimal"
    elif improved:
        status = next(s for s in statuses if s != "optimal")
    else:
        status = "incumbent"
    order = np.argsort(-lens, kind="stable")
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    groups = sorted((sorted(g, key=lambda i: pos[i]) for g in best), key=lambda g: pos[g[0]])
    mbs = cheapest_feasible(groups, lens, spec=spec, layout="packed", sp=k)
    return IlpResult(
        tuple(tuple(int(i) for i in g) for g in groups),
        tuple(mb.recompute for mb in mbs),
        best_ms,
        start_ms,
        status,
        nodes,
    )


def _runs(allowed: list[int]) -> list[tuple[int, int]]:
    """Contiguous runs of the allowed counts: one solve per run."""
    runs = [[allowed[0], allowed[0]]]
    for c in allowed[1:]:
        if c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return [(a, b) for a, b in runs]


@dataclass(frozen=True)
class _Columns:
    """The program's column indices: x[p, j], z[j, r], S[j, r], Q[j, r], W[j, r] (k > 1 only),
    y[j, r, q], t[j] and M (pp > 1 only)."""

    x: dict
    z: dict
    S: dict
    Q: dict
    W: dict
    y: dict
    t: list[int]
    M: int | None


def _quiet_highs() -> highspy.Highs:
    """A solver, made without HiGHS's banner: from 1.16 the first solver of a process prints it on
    the C stdout before any option can turn output off, and stdout carries the CLI's JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _solve(
    lens: np.ndarray,
    model: _Model,
    pp: int,
    lo: int,
    hi: int,
    start: list[list[int]] | None,
    node_limit: int,
    time_limit_s: float | None,
) -> tuple[list[list[int]] | None, str, int]:
    """Solve the program for lo..hi non-empty micro-batches from ``start``; (groups or None, status, nodes)."""
    order = np.argsort(-lens, kind="stable")
    lp, cols = _program([int(lens[i]) for i in order], model, pp, lo, hi)
    h = _quiet_highs()
    for name, val in (
        ("output_flag", False),
        ("threads", 1),
        ("random_seed", SEED),
        ("mip_max_nodes", node_limit),
        ("mip_rel_gap", REL_GAP),
        *OPTIONS.items(),
    ):
        h.setOptionValue(name, val)
    if time_limit_s is not None:
        h.setOptionValue("time_limit", max(float(time_limit_s), 0.0))
    h.passModel(lp)
    if start is not None:
        values = _start_values(start, lens, order, model, lp.num_col_, cols)
        if values is not None:
            sol = highspy.HighsSolution()
            sol.col_value = list(values)
            h.setSolution(sol)
    h.run()
    nodes = int(h.getInfo().mip_node_count)
    name = {
        highspy.HighsModelStatus.kOptimal: "optimal",
        highspy.HighsModelStatus.kTimeLimit: "time_limit",
        highspy.HighsModelStatus.kSolutionLimit: "node_limit",
    }.get(h.getModelStatus(), "incumbent")
    if h.getInfo().primal_solution_status != highspy.SolutionStatus.kSolutionStatusFeasible:
        return None, name, nodes
    values = np.asarray(h.getSolution().col_value)
    groups: list[list[int]] = [[] for _ in range(hi)]
    for (p, j), c in cols.x.items():
        if values[c] > 0.5:
            groups[j].append(int(order[p]))
    return [g for g in groups if g], name, nodes


def _program(s: list[int], model: _Model, pp: int, lo: int, hi: int) -> tuple[highspy.HighsLp, _Columns]:
    """The program (module docstring) over lengths ``s``, longest first, for lo..hi non-empty micro-batches."""
    n, v, R, k = len(s), hi, len(model.modes), model.k
    stages = len(model.linear[0])
    cost: list[float] = []
    lower: list[float] = []
    upper: list[float] = []
    integer: list[int] = []

    def col(c: float, lb: float, ub: float, is_int: bool) -> int:
        cost.append(c)
        lower.append(lb)
        upper.append(ub)
        integer.append(1 if is_int else 0)
        return len(cost) - 1

    fit = [[model.fits(r, s[p], s[p] * s[p], s[p]) for r in range(R)] for p in range(n)]
    x = {(p, j): col(0.0, 0.0, 1.0, True) for p in range(n) for j in range(min(p, v - 1) + 1)}
    z = {(j, r): col(0.0, 0.0, 1.0, True) for j in range(v) for r in range(R)}
    total, square = float(sum(s)), float(sum(t * t for t in s))
    S = {(j, r): col(0.0, 0.0, total / TOKENS, False) for j in range(v) for r in range(R)}
    Q = {(j, r): col(0.0, 0.0, square / SQUARES, False) for j in range(v) for r in range(R)}
    # per-rank token slots: the tokens rounded up to a multiple of k, over k (an integer column at k > 1)
    W = {(j, r): col(0.0, 0.0, float(-(-int(total) // k)), True) for j in range(v) for r in range(R)} if k > 1 else {}

    def slots(j: int, r: int, a: float) -> tuple[int, float]:
        return (W[j, r], a) if k > 1 else (S[j, r], a * TOKENS)

    y = {
        (j, r, q): col(0.0, 0.0, math.inf, False)
        for j in range(v)
        for r in range(R)
        for q in range(len(model.floored[r]))
    }
    t = [col(1.0, 0.0, math.inf, False) for _ in range(v)]
    # the longest sequence's micro-batch takes at least as long as the sequence alone in its cheapest mode
    alone, _ = model.best(s[0], s[0] * s[0], s[0])
    M = col(float(pp - 1), alone if math.isfinite(alone) else 0.0, math.inf, False) if pp > 1 else None

    rows_lo: list[float] = []
    rows_hi: list[float] = []
    starts: list[int] = [0]
    index: list[int] = []
    value: list[float] = []

    def row(terms: list[tuple[int, float]], lb: float, ub: float) -> None:
        for c, a in terms:
            index.append(c)
            value.append(a)
        starts.append(len(index))
        rows_lo.append(lb)
        rows_hi.append(ub)

    inf = math.inf
    for p in range(n):
        row([(x[p, j], 1.0) for j in range(min(p, v - 1) + 1)], 1.0, 1.0)
    for j in range(v):
        members = range(j, n)
        row([(S[j, r], 1.0) for r in range(R)] + [(x[p, j], -s[p] / TOKENS) for p in members], 0.0, 0.0)
        row([(Q[j, r], 1.0) for r in range(R)] + [(x[p, j], -(s[p] ** 2) / SQUARES) for p in members], 0.0, 0.0)
        row([(z[j, r], 1.0) for r in range(R)], -inf, 1.0)
        for p in members:  # a member needs a mode it fits in alone
            row([(x[p, j], 1.0)] + [(z[j, r], -1.0) for r in range(R) if fit[p][r]], -inf, 0.0)
            if j > 0:  # symmetry: a longer sequence sits in the micro-batch before
                row([(x[p, j], 1.0)] + [(x[q, j - 1], -1.0) for q in range(j - 1, p)], -inf, 0.0)
        for r in range(R):
            row([(z[j, r], 1.0)] + [(x[p, j], -1.0) for p in members], -inf, 0.0)
            row([(S[j, r], 1.0), (z[j, r], -total / TOKENS)], -inf, 0.0)
            row([(Q[j, r], 1.0), (z[j, r], -square / SQUARES)], -inf, 0.0)
            if k > 1:
                row([(W[j, r], float(k)), (S[j, r], -TOKENS)], 0.0, inf)
            for a, b, c in model.memory[r]:
                row([(z[j, r], a), slots(j, r, b), (Q[j, r], c / k * SQUARES)], -inf, 0.0)
            for q, (fl, c0, c1, c2) in enumerate(model.floored[r]):
                row([(y[j, r, q], 1.0), (z[j, r], -fl)], 0.0, inf)
                row([(y[j, r, q], 1.0), (z[j, r], -c0), slots(j, r, -c1), (Q[j, r], -c2 / k * SQUARES)], 0.0, inf)
        for st in range(stages):
            terms = [(t[j], 1.0)]
            for r in range(R):
                a, b, c = model.linear[r][st]
                terms += [(z[j, r], -a), slots(j, r, -b), (Q[j, r], -c / k * SQUARES)]
                terms += [(y[j, r, q], -w) for q, w in enumerate(model.weight[r][st]) if w]
            row(terms, 0.0, inf)
        if M is not None:
            row([(M, 1.0), (t[j], -1.0)], 0.0, inf)
    if lo > 0:  # micro-batch lo - 1 non-empty, and with it every one before (symmetry)
        row([(x[p, lo - 1], 1.0) for p in range(lo - 1, n)], 1.0, inf)

    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(cost), len(rows_lo)
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = np.array(cost), np.array(lower), np.array(upper)
    lp.row_lower_, lp.row_upper_ = np.array(rows_lo), np.array(rows_hi)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = (
        np.array(starts, dtype=np.int32),
        np.array(index, dtype=np.int32),
        np.array(value),
    )
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in integer]
    return lp, _Columns(x, z, S, Q, W, y, t, M)


def _start_values(
    start: list[list[int]], lens: np.ndarray, order: np.ndarray, model: _Model, ncol: int, cols: _Columns
) -> np.ndarray | None:
    """Every column's value at a grouping (micro-batches renumbered by their longest sequence, each
    in its cheapest modelled mode); None if the model rejects one of its micro-batches."""
    pos = np.empty(len(lens), dtype=np.int64)
    pos[order] = np.arange(len(lens))
    values = np.zeros(ncol)
    worst = 0.0
    for j, g in enumerate(sorted(start, key=lambda g: min(pos[i] for i in g))):
        tokens = sum(int(lens[i]) for i in g)
        squares = sum(int(lens[i]) ** 2 for i in g)
        tj, r = model.best(tokens, squares, max(int(lens[i]) for i in g))
        if r < 0:
            return None
        for i in g:
            values[cols.x[int(pos[i]), j]] = 1.0
        values[cols.z[j, r]], values[cols.S[j, r]], values[cols.Q[j, r]] = 1.0, tokens / TOKENS, squares / SQUARES
        slots, attn = model.features(tokens, squares)
        if cols.W:
            values[cols.W[j, r]] = slots
        for q, (fl, c0, c1, c2) in enumerate(model.floored[r]):
            values[cols.y[j, r, q]] = max(fl, c0 + c1 * slots + c2 * attn)
        values[cols.t[j]] = tj
        worst = max(worst, tj)
    if cols.M is not None:
        values[cols.M] = worst
    return values


def _group_size(spec: PlannerSpec) -> int:
    if len(spec.sp_sizes) != 1:
        raise ValueError(
            f"plan one pipeline at a time: its spec needs one sequence-parallel size (sp_sizes=(k,)), "
            f"got {spec.sp_sizes}"
        )
    return int(spec.sp_sizes[0])
