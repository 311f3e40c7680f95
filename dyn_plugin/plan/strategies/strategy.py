"""Hydraulis's heterogeneous strategies: proposed from the length distribution, one chosen per step.

Long sequences want wide pipelines (more memory, less time per sequence), short ones many narrow
pipelines (no tensor- or sequence-parallel collectives, no fill and drain); one scheme for every
pipeline is a compromise. A **strategy** is a multiset of pipelines, each of some scheme
(``plan/strategies/schemes.py``), using every GPU.

**Proposal** (offline, from a length distribution). A strategy is designed for the batches whose
longest sequence is at some quantile of the batch's longest (the median batch, the 90th
percentile, every batch): its design batch is the distribution truncated there, scaled to a
step's tokens. Sorted by length, its sequences fall into quantile buckets; a DP over bucket
boundaries gives each run of buckets a scheme and a pipeline count, and a bisection on the step
time T finds the smallest T for which the pipelines it needs fit in the GPUs: a run of work W
whose longest sequence takes t on a scheme of pp stages needs ceil(W / (T - (pp - 1) t))
pipelines (the fluid form of stage 1's finish estimate, load + fill and drain), each sequence
also paying its share of the per-micro-batch fixed cost. GPUs left over go to the runs that
would finish last. The DP runs once per update level (a step waits for its slowest scheme's
gradient synchronisation), giving a few candidates. The fluid model misses recompute, schedules
and memory, so the candidates are then simulated on sampled batches of the design point (each
holding a sequence of its longest) and the best is improved by a local search over trades of
GPUs between schemes, neighbours ranked by stage 1 and the best few simulated. The proposal also
keeps the best homogeneous strategy (one scheme everywhere, holding the longest sequence),
chosen the same way, deduplicated.

**Per step.** The strategies that hold the batch's longest sequence are dispatched (stage 1,
``plan/assignment/dispatch.py``); the best ``PLANNED`` by dispatch makespan get stage 2 and a simulation
(``plan/assignment/two_stage.py``), and the fastest simulated plan wins, so a step is never planned slower
than the homogeneous strategy would be where that one is among the finalists.

Proposals are JSON (never pickle), keyed by a digest of their inputs (``proposal_key``), cached
under that key by ``cached_proposal``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import numpy as np
from tqdm import tqdm

from ...atomic import check_sha256, with_sha256, write_atomic
from ...jsonfile import read_json
from ..assignment.dispatch import Dispatch, dispatch
from ..assignment.two_stage import Pipeline, Stage2Options, plan_members
from ..sequence_parallel.groups import size_limits
from ..steps.microbatch import InfeasibleError
from ..steps.pricing import same_recompute
from ..steps.spec import PlannerSpec
from ..steps.types import StepPlan
from .schemes import Scheme, SchemeCost

PROPOSAL_SCHEMA = "dyn_plugin.strategy_proposal"
PROPOSAL_VERSION = 1
QUANTILES = (1.0, 0.9, 0.5, 0.25)  # of the batch's longest sequence: what the strategies are designed for
BUCKETS = 48  # length buckets of the proposal's DP
PLANNED = 2  # strategies given stage 2 and a simulation per step
# Each planned strategy dispatched again with times corrected by its simulation, in steps of at
# most this many sequences: 0.5-2.6% faster steps at 64 GPUs, for a second stage 2; at 1024 GPUs
# (up to 11,600 sequences) that second stage 2 would take the time planning the next strategy needs.
REBALANCE_SEQUENCES = 2000
REFINE = 24  # simulated neighbours per design point in the proposal's local search
NEIGHBOURS = 4  # neighbours simulated per round of it
DESIGN_BATCHES = 2  # sampled batches every candidate is simulated on
HOMOGENEOUS_TRIED = 3  # homogeneous strategies simulated (the fluid estimate's best)
DESIGN_GPUS = 128  # larger clusters get strategies designed for units of this many GPUs, repeated

logger = logging.getLogger(__name__)


class KindCost(Protocol):
    """What the proposal and stage 1 need of a scheme (``schemes.SchemeCost``)."""

    scheme: Scheme
    spec: PlannerSpec

    @property
    def longest(self) -> int: ...

    @property
    def fixed_ms(self) -> float: ...

    @property
    def update_ms(self) -> float: ...

    def sequence_ms(self, lengths: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class Strategy:
    """Pipelines using every GPU, widest first (so sequence-parallel groups start aligned)."""

    pipelines: tuple[Scheme, ...]
    longest: int  # the longest sequence some pipeline of it can hold
    estimate_ms: float = 0.0  # the proposal's fluid step estimate on its design batch

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in self.pipelines)

    @property
    def counts(self) -> dict[Scheme, int]:
        out: dict[Scheme, int] = {}
        for p in self.pipelines:
            out[p] = out.get(p, 0) + 1
        return out

    @property
    def grouping(self) -> tuple[int, ...]:
        """Sequence-parallel sizes in column order (for strategies with one tp and pp)."""
        return tuple(p.sp for p in self.pipelines)

    def runnable(self, tp: int, pp: int) -> bool:
        """Every pipeline has the host's tensor and pipeline degree: DeepSpeed and Megatron build
        uniform replicas, so only the sequence-parallel size may differ."""
        return all(p.tp == tp and p.pp == pp for p in self.pipelines)

    def describe(self) -> str:
        return " + ".join(f"{n} x {s.name}" for s, n in self.counts.items())

    def to_json(self) -> dict:
        return {
            "pipelines": [[s.to_json(), n] for s, n in self.counts.items()],
            "longest": self.longest,
            "estimate_ms": self.estimate_ms,
        }

    @classmethod
    def from_json(cls, d: dict) -> "Strategy":
        pipes = [Scheme.from_json(s) for s, n in d["pipelines"] for _ in range(int(n))]
        return cls(_ordered(pipes), int(d["longest"]), float(d.get("estimate_ms", 0.0)))


@dataclass(frozen=True)
class Proposal:
    """The strategies a run chooses from per step, and what they were proposed from."""

    strategies: tuple[Strategy, ...]
    key: str  # digest of the inputs (proposal_key)
    inputs: dict = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict:
        """The JSON document, with the checksum of its payload (``sha256``) that ``from_dict`` checks."""
        return with_sha256(
            {
                "schema": PROPOSAL_SCHEMA,
                "version": PROPOSAL_VERSION,
                "key": self.key,
                "inputs": self.inputs,
                "strategies": [s.to_json() for s in self.strategies],
            }
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "strategy proposal") -> "Proposal":
        """Parse and check a proposal; every problem is a ValueError naming ``where`` (its file)."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not valid JSON: {exc}") from None
        except RecursionError:
            raise ValueError(f"{where} is nested too deeply to be a strategy proposal") from None
        return cls.from_dict(d, where)

    @classmethod
    def from_dict(cls, d: object, where: str = "strategy proposal") -> "Proposal":
        again = "write it again with `dynplugin strategy`"
        if not isinstance(d, dict) or d.get("schema") != PROPOSAL_SCHEMA or d.get("version") != PROPOSAL_VERSION:
            schema, version = (d.get("schema"), d.get("version")) if isinstance(d, dict) else (None, None)
            raise ValueError(
                f"{where} is not a strategy proposal of version {PROPOSAL_VERSION} (schema {schema!r}, "
                f"version {version!r}); write one with `dynplugin strategy`"
            )
        d = check_sha256(d, where)
        try:
            strategies = tuple(_strategy_from_json(s) for s in d["strategies"])
            key, inputs = d["key"], d.get("inputs", {})
            if not isinstance(key, str) or not isinstance(inputs, dict):
                raise TypeError("key must be a string and inputs an object")
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            what = f"missing key {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
            raise ValueError(f"{where} does not have the shape of a strategy proposal ({what}); {again}") from None
        if not strategies:
            raise ValueError(f"{where}: a strategy proposal needs at least one strategy")
        return cls(strategies, key, inputs)

    def save(self, path: str | os.PathLike) -> None:
        """Written whole or not at all (``dyn_plugin.atomic``)."""
        write_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Proposal":
        """FileNotFoundError when ``path`` does not exist; a ValueError naming it for anything wrong with it."""
        return cls.from_dict(read_json(path, "strategy proposal"), f"strategy proposal {os.fspath(path)}")


def _strategy_from_json(d: dict) -> Strategy:
    """A strategy of a proposal file, its counts and degrees checked (a KeyError, TypeError or ValueError
    for a malformed one, which ``Proposal.from_dict`` turns into one naming the file)."""
    for scheme, n in d["pipelines"]:
        if int(n) < 1 or min(int(scheme["tp"]), int(scheme["pp"]), int(scheme["sp"])) < 1:
            raise ValueError(f"pipeline {scheme} x {n}: counts and degrees must be >= 1")
    strategy = Strategy.from_json(d)
    if strategy.longest < 1:
        raise ValueError(f"longest {strategy.longest} must be >= 1")
    return strategy


def _ordered(pipes: Sequence[Scheme]) -> tuple[Scheme, ...]:
    return tuple(sorted(pipes, key=lambda s: (-s.gpus, -s.sp, -s.tp, -s.pp)))


def proposal_key(
    lengths: np.ndarray,
    kinds: Sequence[KindCost],
    *,
    gpus: int,
    tokens: int,
    max_strategies: int,
    model: str = "",
    refine: int = REFINE,
    batches: int = DESIGN_BATCHES,
    seed: int = 0,
) -> str:
    """A digest of everything a proposal depends on: the lengths, the schemes with their costs
    (coefficients and memory limits, through their specs), the cluster size and the step's tokens."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(np.sort(np.asarray(lengths, dtype=np.int64))).tobytes())
    probe = np.array([1, 128, 1024, 8192, 32768], dtype=np.int64)
    for k in kinds:
        h.update(repr((k.scheme, k.longest, k.spec.update_ms, k.sequence_ms(probe).round(9).tolist())).encode())
    h.update(repr((gpus, tokens, max_strategies, model, refine, batches, seed, PROPOSAL_VERSION)).encode())
    return h.hexdigest()[:16]


def propose(
    lengths: Sequence[int],
    kinds: Sequence[KindCost],
    *,
    gpus: int,
    tokens: int,
    max_strategies: int = 3,
    model: str = "",
    refine: int = REFINE,
    batches: int = DESIGN_BATCHES,
    seed: int = 0,
    progress: bool = False,
) -> Proposal:
    """Strategies for a length distribution (see the module docstring). Raises ValueError naming
    the longest sequence when no scheme holds it. ``refine``: simulated neighbours tried per
    design point; ``batches``: design batches each candidate is simulated on."""
    lens = np.sort(np.asarray(lengths, dtype=np.int64))
    if len(lens) == 0:
        raise ValueError("a strategy proposal needs at least one sequence length")
    if not kinds:
        raise ValueError("no scheme to propose strategies from: none fits the model in memory")
    longest = int(lens[-1])
    if not any(k.longest >= longest for k in kinds):
        best = max(k.longest for k in kinds)
        raise ValueError(
            f"the longest sequence ({longest} tokens) fits no scheme (the widest holds {best}); allow "
            "wider schemes (tensor, pipeline or sequence parallel), raise the memory, or cap "
            "microbatching.max_seq_len"
        )
    by_scheme = {k.scheme: k for k in kinds}
    per_step = tokens / float(lens.mean())  # sequences in a step
    # Beyond DESIGN_GPUS the strategies are designed and simulated for one unit of that many GPUs
    # and a unit's share of the step, then repeated: simulating a 1024-GPU step per candidate would
    # take the proposal minutes; the design points (the step's longest) stay the whole step's.
    copies = gpus // DESIGN_GPUS if gpus > DESIGN_GPUS and gpus % DESIGN_GPUS == 0 else 1
    unit, unit_tokens = gpus // copies, tokens // copies
    kinds = [k for k in kinds if k.scheme.gpus <= unit]
    times = np.stack([k.sequence_ms(lens) for k in kinds])
    points = []
    for j, q in enumerate(QUANTILES[:max_strategies]):
        # the batch's longest sequence is at quantile q when every sequence is at quantile q**(1/n)
        x = int(np.quantile(lens, q ** (1.0 / max(per_step, 1.0)), method="higher"))
        upto = int(np.searchsorted(lens, x, side="right"))
        points.append((x, upto, design_batches(lens[:upto], x, unit_tokens, batches, seed + j)))
    found: list[Strategy] = []
    bar = tqdm(total=len(points) + 1, desc="strategies", unit="design", disable=not progress)
    for _x, upto, sample in points:
        cands = candidates(lens[:upto], times[:, :upto], kinds, gpus=unit, tokens=unit_tokens)
        s = refined(cands, sample, kinds, by_scheme, budget=refine)
        if s is not None and s.pipelines not in {f.pipelines for f in found}:
            found.append(s)
        bar.update()
    # the best homogeneous strategy for every step, by simulation among the fluid estimate's best few
    x, _, sample = points[0]
    homo = sorted(
        homogeneous_all(lens, kinds, gpus=unit, tokens=unit_tokens, times=times), key=lambda s: s.estimate_ms
    )[:HOMOGENEOUS_TRIED]
    scored = [(simulated_ms(h, sample, by_scheme), h) for h in homo]
    ms, h = min(scored, key=lambda t: t[0])
    if h.pipelines not in {f.pipelines for f in found}:
        found.append(replace(h, estimate_ms=ms))
    bar.update()
    bar.close()
    found = [replace(f, pipelines=_ordered(f.pipelines * copies)) for f in found]
    key = proposal_key(
        lens,
        kinds,
        gpus=gpus,
        tokens=tokens,
        max_strategies=max_strategies,
        model=model,
        refine=refine,
        batches=batches,
        seed=seed,
    )
    inputs = {
        "model": model,
        "gpus": gpus,
        "tokens": tokens,
        "sequences": int(len(lens)),
        "longest": longest,
        "schemes": [k.scheme.name for k in kinds],
        "design_longest": [p[0] for p in points],
        "design_gpus": unit,
    }
    return Proposal(tuple(sorted(found, key=lambda s: (s.longest, s.estimate_ms))), key, inputs)


def design_batches(lens: np.ndarray, longest: int, tokens: int, count: int, seed: int) -> list[np.ndarray]:
    """``count`` batches of about ``tokens`` tokens drawn from ``lens`` (seeded), each holding one
    sequence of ``longest``: the design point's batches, whose longest sequence sets the critical path."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        draw = rng.choice(lens, size=int(2 * tokens / max(float(lens.mean()), 1.0)) + 2)
        keep = draw[np.cumsum(draw) <= tokens - longest]
        out.append(np.concatenate([[longest], keep]).astype(np.int64))
    return out


def simulated_ms(strategy: Strategy, batches: Sequence[np.ndarray], kinds: dict[Scheme, KindCost]) -> float:
    """A strategy's mean simulated step over the batches (inf where one cannot run)."""
    total = 0.0
    for b in batches:
        try:
            total += plan_cluster_step(b, [strategy], kinds, planned=1)[0].iteration_ms
        except InfeasibleError:
            return math.inf
    return total / len(batches)


def dispatched_ms(strategy: Strategy, batches: Sequence[np.ndarray], kinds: dict[Scheme, KindCost]) -> float:
    """Stage 1's quick price of a strategy: its mean dispatch makespan (the greedy alone: this only
    ranks neighbours) plus its largest update."""
    order = list(dict.fromkeys(strategy.pipelines))
    update = max(kinds[k].update_ms for k in order)
    total = 0.0
    for b in batches:
        times = np.stack([kinds[k].sequence_ms(b) for k in order])
        try:
            total += dispatch(
                times, [order.index(p) for p in strategy.pipelines], [k.pp - 1 for k in order], b, improve=False
            ).makespan_ms
        except InfeasibleError:
            return math.inf
    return total / len(batches) + update


def refined(
    cands: Sequence[Strategy],
    batches: Sequence[np.ndarray],
    kinds: Sequence[KindCost],
    by_scheme: dict[Scheme, KindCost],
    *,
    budget: int,
) -> Strategy | None:
    """The DP's candidates simulated on the design batches, then the best improved by local search:
    a neighbour trades GPUs between schemes the candidates use and their sequence-parallel siblings
    (one pipeline split into narrower ones, narrower ones merged into one, or one pipeline of
    another scheme of its size). Neighbours are ranked by stage 1's dispatch makespan; the best
    ``NEIGHBOURS`` are simulated per round, until none improves or ``budget`` simulations ran."""
    scored = [(simulated_ms(c, batches, by_scheme), c) for c in cands]
    scored = [t for t in scored if math.isfinite(t[0])]
    if not scored:
        return None
    best_ms, best = min(scored, key=lambda t: t[0])
    used = {p for c in cands for p in c.pipelines}
    pool = sorted(
        {k.scheme for k in kinds if any(k.scheme.tp == u.tp and k.scheme.pp == u.pp for u in used)},
        key=lambda s: (s.gpus, s.tp, s.pp, s.sp),
    )
    tried = {c.pipelines for c in cands}
    while budget > 0:
        fresh = [n for n in neighbours(best, pool) if n not in tried]
        tried.update(fresh)
        if not fresh:
            break
        ranked = sorted(fresh, key=lambda n: dispatched_ms(Strategy(n, 0), batches, by_scheme))[:NEIGHBOURS]
        budget -= len(ranked)
        trial = [
            (simulated_ms(Strategy(n, max(by_scheme[p].longest for p in n)), batches, by_scheme), n) for n in ranked
        ]
        ms, n = min(trial, key=lambda t: t[0])
        if ms >= best_ms:
            break
        best_ms, best = ms, Strategy(n, max(by_scheme[p].longest for p in n))
    return replace(best, estimate_ms=best_ms)


def neighbours(strategy: Strategy, pool: Sequence[Scheme]) -> list[tuple[Scheme, ...]]:
    """Strategies one trade of GPUs away (same GPUs in all), widest first."""
    counts = strategy.counts
    out = []
    for x, n in counts.items():
        for y in pool:
            if y == x:
                continue
            if y.gpus <= x.gpus and x.gpus % y.gpus == 0:  # one x becomes x.gpus / y.gpus of y
                new = dict(counts)
                new[x] -= 1
                new[y] = new.get(y, 0) + x.gpus // y.gpus
                out.append(new)
            if y.gpus > x.gpus and y.gpus % x.gpus == 0 and n >= y.gpus // x.gpus:  # that many x become one y
                new = dict(counts)
                new[x] -= y.gpus // x.gpus
                new[y] = new.get(y, 0) + 1
                out.append(new)
    return list(dict.fromkeys(_ordered([s for s, c in d.items() for _ in range(c)]) for d in out))


def candidates(
    lens: np.ndarray, times: np.ndarray, kinds: Sequence[KindCost], *, gpus: int, tokens: int
) -> list[Strategy]:
    """The proposal's DP for one design batch: ``lens`` sorted ascending, ``times[k, i]`` sequence
    i's time on kind k (inf where it does not fit); one strategy per update level.

    A step ends with every pipeline's update (the gradient synchronisation waits for the last
    pipeline), so a strategy pays the largest update of its schemes: narrow schemes sync more
    parameters per GPU. The DP runs once per update level, on the schemes within it."""
    eff = effective_ms(lens, times, kinds)
    update = np.array([k.update_ms for k in kinds])
    out = []
    for u in np.unique(update):
        within = np.flatnonzero(update <= u)
        s = _design_within(lens, eff[within], [kinds[i] for i in within], gpus=gpus, tokens=tokens)
        if s is not None and s.pipelines not in {o.pipelines for o in out}:
            out.append(replace(s, estimate_ms=s.estimate_ms + float(u)))
    return out


def effective_ms(lens: np.ndarray, times: np.ndarray, kinds: Sequence[KindCost]) -> np.ndarray:
    """Sequence times with their share of the per-micro-batch fixed cost: a micro-batch holds up
    to about the longest sequence a scheme fits, so a sequence of s tokens pays s / longest of it."""
    fixed = np.array([k.fixed_ms / max(k.longest, 1) for k in kinds])
    return times + fixed[:, None] * lens[None, :].astype(float)


def _design_within(
    lens: np.ndarray, times: np.ndarray, kinds: Sequence[KindCost], *, gpus: int, tokens: int
) -> Strategy | None:
    n = len(lens)
    weight = tokens / float(lens.sum())  # expected copies of each sequence in a step
    edges = np.unique(np.linspace(0, n, min(BUCKETS, n) + 1).round().astype(np.int64))
    q = len(edges) - 1
    finite = np.where(np.isfinite(times), times, 0.0) * weight
    prefix = np.concatenate([np.zeros((len(kinds), 1)), np.cumsum(finite, axis=1)], axis=1)[:, edges]  # (K, q+1)
    work = prefix[:, None, :] - prefix[:, :, None]  # work[k, a, b]: buckets a..b-1
    tmax = times[:, edges[1:] - 1]  # (K, q): the longest (last) sequence of each end bucket b-1
    size = np.array([k.scheme.gpus for k in kinds], dtype=float)
    fill = np.array([k.scheme.pp - 1 for k in kinds], dtype=float)
    fits = np.isfinite(tmax)
    tfin = np.where(fits, tmax, 0.0)

    def needed(T: float) -> tuple[float, list[tuple[int, int, int, int]]]:
        """Fewest GPUs that finish the batch within T, and the runs (a, b, kind, pipelines)."""
        room = T - fill[:, None] * tfin  # (K, q)
        ok = fits & (tfin <= room)
        best = np.full(q + 1, np.inf)
        best[0] = 0.0
        back: list[tuple[int, int, int]] = [(-1, -1, 0)] * (q + 1)
        for b in range(1, q + 1):
            r = np.where(ok[:, b - 1], room[:, b - 1], np.inf)[:, None]
            pipes = np.maximum(1.0, np.ceil(work[:, :b, b] / r - 1e-9))
            total = best[None, :b] + np.where(np.isfinite(r), pipes, np.inf) * size[:, None]
            k, a = np.unravel_index(int(np.argmin(total)), total.shape)
            best[b] = total[k, a]
            back[b] = (int(a), int(k), int(pipes[k, a]))
        runs, b = [], q
        while b > 0 and np.isfinite(best[b]):
            a, k, p = back[b]
            runs.append((a, b, k, p))
            b = a
        return best[q], runs[::-1]

    hi = float(tfin.max()) * (1 + fill.max()) + float(finite.sum(axis=1).min()) + 1.0
    while needed(hi)[0] > gpus:
        hi *= 2
        if hi > 1e12:
            return None
    lo = 0.0
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if needed(mid)[0] <= gpus else (mid, hi)
    _, runs = needed(hi)
    counts = [p for _, _, _, p in runs]
    left = gpus - sum(p * size[k] for _, _, k, p in runs)

    def finish(i: int) -> float:
        a, b, k, _ = runs[i]
        return max(work[k, a, b] / counts[i] + fill[k] * tfin[k, b - 1], (1 + fill[k]) * tfin[k, b - 1])

    # the GPUs the bisection left over: one more pipeline where the step would finish last
    while True:
        fits_left = [i for i, (_, _, k, _) in enumerate(runs) if size[k] <= left]
        if not fits_left:
            break
        i = max(fits_left, key=finish)
        counts[i] += 1
        left -= size[runs[i][2]]
    pipes = [kinds[k].scheme for (_, _, k, _), c in zip(runs, counts) for _ in range(c)]
    return Strategy(
        _ordered(pipes),
        max(int(kinds[k].longest) for _, _, k, _ in runs),
        float(max(finish(i) for i in range(len(runs)))),
    )


def homogeneous_all(
    lengths: Sequence[int], kinds: Sequence[KindCost], *, gpus: int, tokens: int, times: np.ndarray | None = None
) -> list[Strategy]:
    """Every homogeneous strategy holding the longest sequence (one scheme, as many of its
    pipelines as the GPUs hold; the seed's and most systems' one strategy for every step), with
    the fluid estimate of its step."""
    lens = np.sort(np.asarray(lengths, dtype=np.int64))
    times = effective_ms(lens, np.stack([k.sequence_ms(lens) for k in kinds]) if times is None else times, kinds)
    weight = tokens / float(lens.sum())
    out = []
    for i, k in enumerate(kinds):
        n = gpus // k.scheme.gpus
        if n == 0 or k.longest < lens[-1]:
            continue
        t = times[i]
        est = float(t.sum()) * weight / n + (k.scheme.pp - 1) * float(t[-1])
        out.append(Strategy((k.scheme,) * n, int(k.longest), max(est, k.scheme.pp * float(t[-1])) + k.update_ms))
    if not out:
        raise ValueError(f"no single scheme holds the longest sequence ({int(lens[-1])} tokens) on {gpus} GPUs")
    return out


def scheme_kinds(lengths: Sequence[int], spec: PlannerSpec) -> list[SchemeCost]:
    """The run's own schemes: its tensor and pipeline degrees with each allowed sequence-parallel
    size, priced on its spec, their limits found over the run's distinct lengths."""
    lens = np.unique(np.asarray(lengths, dtype=np.int64))
    limits = size_limits(lens, spec, "packed")
    return [
        SchemeCost(
            Scheme(spec.tp, spec.pp, k),
            replace(spec, sp_sizes=(k,)),
            {rc: limits.by_mode[(k, rc)] for rc in spec.recomputes},
        )
        for k in spec.sp_sizes
    ]


def runnable_proposal(lengths: Sequence[int], spec: PlannerSpec, *, tokens: int, max_strategies: int = 3) -> Proposal:
    """Strategies a DeepSpeed run can execute: its data-parallel columns grouped by sequence-parallel
    size (one tensor and pipeline degree), proposed from the run's lengths."""
    if "packed" not in spec.layouts:
        raise ValueError(
            "strategies cut packed micro-batches (Hydraulis packs each pipeline's sequences); "
            "set microbatching.layout to 'packed' or 'auto'"
        )
    kinds = [k for k in scheme_kinds(lengths, spec) if k.longest > 0]
    return propose(
        lengths,
        kinds,
        gpus=spec.dp * spec.tp * spec.pp,
        tokens=tokens,
        max_strategies=max_strategies,
        model=spec.cost.name,
    )


def plan_strategy_step(
    lengths: Sequence[int],
    spec: PlannerSpec,
    proposal: Proposal,
    *,
    stage2: Stage2Options = Stage2Options(),
    native: bool = True,
) -> StepPlan:
    """A step of a real run under the proposal: its strategies must be runnable (one tensor and
    pipeline degree, ``spec.dp`` columns); every group must get work, with ZeRO-2/3's equal counts
    and ZeRO-3's same recompute per micro-batch index when the spec asks for them."""
    kinds = {k.scheme: k for k in scheme_kinds(lengths, spec)}
    for s in proposal.strategies:
        if not s.runnable(spec.tp, spec.pp) or sum(p.sp for p in s.pipelines) != spec.dp:
            raise ValueError(
                f"strategy {s.describe()} does not run on {spec.dp} data-parallel columns of "
                f"tp={spec.tp}, pp={spec.pp}: heterogeneous tensor/pipeline degrees are simulated only "
                "(dynplugin bench strategy)"
            )
    plan, _ = plan_cluster_step(
        lengths,
        proposal.strategies,
        kinds,
        stage2=stage2,
        native=native,
        equal_counts=spec.equal_counts,
        every_pipeline=True,
    )
    return same_recompute(plan, spec=spec)


def plan_cluster_step(
    lengths: Sequence[int],
    strategies: Sequence[Strategy],
    kinds: dict[Scheme, KindCost],
    *,
    stage2: Stage2Options = Stage2Options(),
    dispatcher: Callable[..., Dispatch] = dispatch,
    native: bool = True,
    equal_counts: bool = False,
    every_pipeline: bool = False,
    method: str = "hydraulis",
    planned: int = PLANNED,
    rebalance: bool | None = None,
) -> tuple[StepPlan, Strategy]:
    """The fastest simulated step, and the strategy it runs, over the strategies that hold the
    batch's longest sequence: each dispatched (stage 1), the ``planned`` best by dispatch makespan
    (plus the strategy's largest update) cut (stage 2) and simulated.

    ``rebalance``: stage 1 balances estimates that leave out what the simulation knows
    (recompute, per-micro-batch costs, fill and drain of the real schedule), so pipelines of one
    scheme can finish well before another's. Each planned strategy of several schemes is
    dispatched once more with every scheme's times scaled by its pipelines' simulated over
    estimated time, and the faster of the two plans kept (default: in steps of at most
    ``REBALANCE_SEQUENCES`` sequences).
    ``every_pipeline``: a strategy leaving some pipeline without work is skipped (a real run's
    group must join the step). Raises InfeasibleError when no strategy can run the batch."""
    lens = np.asarray(lengths, dtype=np.int64)
    longest = int(lens.max())
    rebalance = len(lens) <= REBALANCE_SEQUENCES if rebalance is None else rebalance
    fitting = [s for s in strategies if s.longest >= longest]
    dispatched = []
    for s in fitting:
        order = list(dict.fromkeys(s.pipelines))
        stage1 = (
            np.stack([kinds[k].sequence_ms(lens) for k in order]),
            [order.index(p) for p in s.pipelines],
            [k.pp - 1 for k in order],
        )
        try:
            d = dispatcher(*stage1, lens, native=native)
        except InfeasibleError:
            continue
        if every_pipeline and not all(d.members):
            continue
        # the step waits for the slowest pipeline, then for the strategy's largest update
        dispatched.append((d.makespan_ms + max(kinds[k].update_ms for k in order), s, d, stage1))
    dispatched.sort(key=lambda x: x[0])
    best = None
    for _, s, d, (times, kind_of, fill) in dispatched[:planned]:
        plan = _cut(lens, s, d, kinds, method=method, stage2=stage2, native=native, equal_counts=equal_counts)
        if plan is not None and rebalance and len(times) > 1:
            sim, est = np.zeros(len(times)), np.zeros(len(times))
            for p, rep in zip((p for p, ids in enumerate(d.members) if ids), plan.replicas):
                sim[kind_of[p]] += rep.sim.makespan_ms
                est[kind_of[p]] += d.finish_ms[p]
            ratio = np.where((est > 0) & (sim > 0), sim / np.where(est > 0, est, 1.0), 1.0)
            again = dispatcher(times * ratio[:, None], kind_of, fill, lens, native=native)
            if again.members != d.members and not (every_pipeline and not all(again.members)):
                other = _cut(
                    lens, s, again, kinds, method=method, stage2=stage2, native=native, equal_counts=equal_counts
                )
                if other is not None and other.iteration_ms < plan.iteration_ms:
                    plan = other
        if plan is not None and (best is None or plan.iteration_ms < best[0].iteration_ms):
            best = plan, s
    if best is None:
        raise InfeasibleError(
            f"no strategy runs this batch (longest sequence {longest}): "
            f"{len(fitting)} of {len(strategies)} hold it, and none could give every pipeline "
            "sequences that fit its memory; propose strategies for longer sequences or more GPUs"
        )
    return best


def _cut(
    lens: np.ndarray,
    strategy: Strategy,
    d: Dispatch,
    kinds: dict[Scheme, KindCost],
    *,
    method: str,
    stage2: Stage2Options,
    native: bool,
    equal_counts: bool,
) -> StepPlan | None:
    """Stage 2 for a dispatch: its busy pipelines at their columns (idle ones sit the step out)."""
    firsts = np.cumsum([0] + [p.sp for p in strategy.pipelines[:-1]]).tolist()
    busy = [
        (Pipeline(kinds[p].spec, p.sp, first), ids)
        for p, first, ids in zip(strategy.pipelines, firsts, d.members)
        if ids
    ]
    return plan_members(
        lens,
        [ids for _, ids in busy],
        [p for p, _ in busy],
        "packed",
        method=method,
        stage2=stage2,
        native=native,
        equal_counts=equal_counts,
    )


def cached_proposal(key: str, directory: str | os.PathLike, make: Callable[[], Proposal]) -> Proposal:
    """The proposal stored under ``key`` in ``directory`` (JSON with its checksum), else ``make()``'s,
    stored there. A cached file that is unreadable, damaged (its checksum), has none, or holds another
    key is proposed again and replaced, with a warning naming it."""
    path = os.path.join(directory, f"strategy-{key}.json")
    if os.path.exists(path):
        where = f"strategy proposal {path}"
        try:
            d = read_json(path, "strategy proposal")
            if isinstance(d, dict):
                check_sha256(d, where, required=True)  # the cache holds only files it wrote whole
            found = Proposal.from_dict(d, where)
            if found.key != key:
                raise ValueError(f"strategy proposal {path} holds key {found.key!r}, not {key!r}")
        except (ValueError, OSError) as exc:
            logger.warning("strategy proposal cache %s is not usable (%s); proposing again and replacing it", path, exc)
        else:
            logger.info("strategy proposal %s from the cache %s", key, path)
            return found
    made = make()
    os.makedirs(directory, exist_ok=True)
    made.save(path)  # a unique temporary file renamed into place: readers never see half a file
    return made
