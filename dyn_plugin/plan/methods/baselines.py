"""What existing systems do with the same global batch, priced and simulated like the planner.

- ``fixed_padding``: Megatron's default: a fixed number of sequences per micro-batch, each
  padded to the maximum sequence length.
- ``token_budget``: DeepSpeed's ``batch_by_seqlens``: sequences in loader order fill a micro-batch
  while their summed lengths stay within a token budget; each micro-batch is padded to its
  longest (pipelines need one shape per micro-batch).
- ``packing_full``: fixed-length packing (first-fit decreasing into rows of the maximum length),
  attention over the whole row: Megatron's packing, the baseline DynaPipe beat.
- ``packing_varlen``: the same rows with per-document attention: the strongest baseline.

With sequence parallelism (sequences split over groups of data-parallel columns):

- ``fixed_sp``: one group size for every sequence (DeepSpeed Ulysses or Megatron context
  parallelism as configured today), the size a user would tune: the fastest of those the longest
  sequence fits in, for this batch; given the planner's own micro-batching and schedule search,
  so it isolates what a size per sequence is worth. ``fixed_sp_smallest``: the smallest such size,
  shown beside it (the untuned choice).
- ``megatron_hybrid_cp``: Megatron-Core's hybrid context parallelism: each sequence gets
  2^ceil(log2(L / per-rank capacity)) ranks (more where its quadratic attention memory needs
  them), workload s^2/k balanced over the groups, THD rows packed up to capacity * k tokens.
- ``dcp_bucket``: the DCP seed's bucket parallelism: lengths bucketed by powers of two, each
  bucket at the size with the best profiled time per device and the largest batch that fits,
  columns shared out by the buckets' time.

Each uses one recompute mode for the whole step, the cheapest in which every micro-batch fits,
as a user would configure it; micro-batches go to replicas round-robin and every pipeline runs
plain 1F1B in loader order, as the host frameworks do. Sizes (sequences per micro-batch, token
budget, rows per micro-batch) are the largest that fit memory: the baselines at their best.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from ...cost.model import Layout, Recompute
from ...lengths.packing import pack_rows
from ..sequence_parallel.groups import aligned_firsts, plan_groups, sequence_ms, size_limits
from ..steps.assign import split_for_replicas
from ..steps.microbatch import InfeasibleError
from ..steps.pricing import make_micro_batch, usable
from ..steps.replicas import schedule_replica, schedule_replicas
from ..steps.spec import PlannerSpec
from ..steps.types import MicroBatch, StepPlan


def _uniform(
    groups: list[list[int]],
    lengths: Sequence[int],
    spec: PlannerSpec,
    layout: Layout,
    method: str,
    sp: Sequence[int] | None = None,
) -> list[MicroBatch]:
    """Price the groups (split over ``sp[i]`` ranks each) with the cheapest recompute mode in which all of them fit."""
    sp = sp or [1] * len(groups)
    rc = _uniform_mode(groups, lengths, spec, layout, sp)
    if rc is None:
        raise InfeasibleError(f"{method}: some micro-batch fits in no recompute mode")
    return [make_micro_batch(g, lengths, spec=spec, layout=layout, recompute=rc, sp=k) for g, k in zip(groups, sp)]


def _uniform_mode(
    groups: list[list[int]], lengths: Sequence[int], spec: PlannerSpec, layout: Layout, sp: Sequence[int]
) -> Recompute | None:
    """The cheapest recompute mode in which every group fits, or None. The groups of most padded
    tokens per rank are tried first: searches (``token_budget``'s) ask this of many groupings that
    fail, and most fail on their largest group."""
    order = sorted(range(len(groups)), key=lambda i: -len(groups[i]) * max(lengths[j] for j in groups[i]) / sp[i])
    for rc in spec.recomputes:
        try:
            if all(
                usable(make_micro_batch(groups[i], lengths, spec=spec, layout=layout, recompute=rc, sp=sp[i]), spec)
                for i in order
            ):
                return rc
        except ValueError:
            continue
    return None


def _largest(feasible: Callable[[int], bool], lower: int, upper: int) -> int:
    """Largest n in [lower, upper] with feasible(n) (0 if none), assuming feasibility shrinks as n grows."""
    if not feasible(lower):
        return 0
    lo, hi = lower, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if feasible(mid) else (lo, mid - 1)
    return lo


def _fits_somehow(spec: PlannerSpec, lens: list[int], layout: Layout, sp: int = 1) -> bool:
    for rc in spec.recomputes:
        if usable(make_micro_batch(range(len(lens)), lens, spec=spec, layout=layout, recompute=rc, sp=sp), spec):
            return True
    return False


def fixed_padding(lengths: Sequence[int], spec: PlannerSpec, max_len: int) -> StepPlan:
    n = _largest(lambda k: _fits_somehow(spec, [max_len] * k, "padded"), 1, len(lengths))
    if n == 0:
        raise InfeasibleError(f"fixed_padding: one sequence padded to {max_len} does not fit")
    groups = split_for_replicas(
        [list(range(i, min(i + n, len(lengths)))) for i in range(0, len(lengths), n)],
        lengths,
        spec.dp,
        equal_counts=False,
    )
    padded = [max_len] * len(lengths)  # every sequence padded to max_len, not to its micro-batch's longest
    mbs = _uniform(groups, padded, spec, "padded", "fixed_padding")
    return schedule_replicas(
        [_relabel(mb, g, lengths) for mb, g in zip(mbs, groups)],
        spec=spec,
        method="fixed_padding",
        balance=False,
        adaptive=False,
    )


def budget_groups(lengths: Sequence[int], budget: int, max_batch_size: int | None = None) -> list[list[int]]:
    """DeepSpeed's ``batch_by_seqlens`` with ``sequence_picking_order="dataloader"``: sequences in
    loader order fill a micro-batch while the sum of their lengths stays within ``budget`` (and
    their count within ``max_batch_size``). DeepSpeed's loop stops one sequence short, so its last
    micro-batch misses the final sequence; here every sequence is kept."""
    groups, cur, total = [], [], 0
    for i, s in enumerate(lengths):
        if cur and (total + s > budget or len(cur) == max_batch_size):
            groups.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += s
    return groups + [cur] if cur else groups


def token_budget(lengths: Sequence[int], spec: PlannerSpec) -> StepPlan:
    """The largest ``max_tokens`` whose micro-batches, each padded to its longest, all fit: the
    value a user would tune it to; where none does (a long sequence grouped with another no
    longer fits), the batch size is capped too, as ``max_batch_size`` lets a user do."""

    def groups_for(budget: int, cap: int | None) -> list[list[int]]:
        return split_for_replicas(budget_groups(lengths, budget, cap), lengths, spec.dp, equal_counts=False)

    def fits(budget: int, cap: int | None) -> bool:
        groups = groups_for(budget, cap)
        return _uniform_mode(groups, lengths, spec, "padded", [1] * len(groups)) is not None

    for cap in (None, 8, 4, 2, 1):
        budget = _largest(lambda b: fits(b, cap), max(lengths), sum(lengths))
        if budget:
            mbs = _uniform(groups_for(budget, cap), lengths, spec, "padded", "token_budget")
            return schedule_replicas(mbs, spec=spec, method="token_budget", balance=False, adaptive=False)
    raise InfeasibleError("token_budget: the longest sequence alone does not fit")


def packing(lengths: Sequence[int], spec: PlannerSpec, row_len: int, *, varlen: bool) -> StepPlan:
    method = "packing_varlen" if varlen else "packing_full"
    rows = split_for_replicas(pack_rows(lengths, row_len), lengths, spec.dp, equal_counts=False)
    if varlen:
        # per-document attention needs no fill: each row is priced and run as its real tokens
        mbs = _uniform(rows, lengths, spec, "packed", method)
    else:
        # whole-row attention: priced as one padded row of row_len, whatever its documents, and
        # collated as that row (the documents concatenated, padded to its width)
        priced = _uniform([[r] for r in range(len(rows))], [row_len] * len(rows), spec, "padded", method)
        mbs = [_relabel(mb, r, lengths) for mb, r in zip(priced, rows)]
    return schedule_replicas(mbs, spec=spec, method=method, balance=False, adaptive=False)


def _relabel(mb: MicroBatch, sample_ids: Sequence[int], lengths: Sequence[int]) -> MicroBatch:
    """The same priced micro-batch, carrying the real samples it holds."""
    return replace(mb, sample_ids=tuple(sample_ids), seq_lens=tuple(int(lengths[i]) for i in sample_ids))


def fixed_sp(lengths: Sequence[int], spec: PlannerSpec, *, tuned: bool = True) -> StepPlan:
    """One group size for the whole step: the fastest feasible one (``tuned``), else the smallest."""
    lens = np.asarray(lengths, dtype=np.int64)
    smallest = size_limits(lens, spec, "packed").smallest(int(lens.max()))
    if smallest is None:
        raise InfeasibleError(f"fixed_sp: the longest sequence ({int(lens.max())}) fits in no group of {spec.sp_sizes}")
    sizes = [k for k in spec.sp_sizes if k >= smallest and spec.dp % k == 0] if tuned else [smallest]
    plans = []
    for k in sizes:
        try:
            plans.append(plan_groups(lens, spec, grouping=(k,) * (spec.dp // k)))
        except InfeasibleError:
            continue  # a wider group may still fit what a narrower one cannot hold
    if not plans:
        raise InfeasibleError(f"fixed_sp: no group size of {sizes} runs the batch")
    best = min(plans, key=lambda p: p.iteration_ms)
    return replace(best, method="fixed_sp" if tuned else "fixed_sp_smallest")


def megatron_hybrid_cp(lengths: Sequence[int], spec: PlannerSpec) -> StepPlan:
    if 1 not in spec.sp_sizes:  # its short sequences run on one rank each
        raise InfeasibleError("megatron_hybrid_cp: needs sequence_parallel.sizes to include 1")
    lens = np.asarray(lengths, dtype=np.int64)
    limits = size_limits(lens, spec, "packed")
    if limits.longest[1] == 0:
        raise InfeasibleError("megatron_hybrid_cp: not even the shortest sequence fits one rank")
    # max_seqlen_per_dp_cp_rank as a user would tune it: the largest per-rank capacity whose rows fit
    for capacity in sorted({max(1, int(limits.longest[1] * f)) for f in (1.0, 0.75, 0.5, 0.375, 0.25)}, reverse=True):
        # Megatron's rule counts tokens only; where quadratic attention memory needs more ranks, give them
        cp = [
            _allowed(
                max(1 << max(0, math.ceil(math.log2(s / capacity))), limits.smallest(s) or spec.sp_sizes[-1]), spec
            )
            for s in lens.tolist()
        ]
        work = (lens.astype(float) ** 2) / np.asarray(cp)

        def rows(k: int, ids: list[int], capacity: int = capacity) -> list[list[int]]:
            return [[ids[j] for j in row] for row in pack_rows(lens[ids], max(capacity * k, int(lens[ids].max())))]

        try:
            return _sized_plan(lens, cp, work, rows, spec, "megatron_hybrid_cp")
        except InfeasibleError as exc:
            last = exc
    raise last


def _allowed(k: int, spec: PlannerSpec) -> int:
    """The smallest allowed group size of at least ``k`` (the same sizes every method may use)."""
    size = next((a for a in spec.sp_sizes if a >= k), None)
    if size is None:
        raise InfeasibleError(
            f"a sequence needs a group of {k} ranks; sequence_parallel.sizes allows at most {spec.sp_sizes[-1]}"
        )
    return size


def dcp_bucket(lengths: Sequence[int], spec: PlannerSpec) -> StepPlan:
    lens = np.asarray(lengths, dtype=np.int64)
    bucket = np.ceil(np.log2(lens)).astype(int)
    size = np.zeros(len(lens), dtype=int)
    per_seq = np.zeros(len(lens))
    batch: dict[int, int] = {}
    limits = size_limits(lens, spec, "packed")
    for b in np.unique(bucket):
        top = int(lens[bucket == b].max())
        times = {k: sequence_ms(np.array([top]), k, spec, "packed", limits)[0] * k for k in spec.sp_sizes}
        k = min(times, key=lambda k: (times[k], k))  # the best profiled time per device
        if not np.isfinite(times[k]):
            raise InfeasibleError(f"dcp_bucket: sequences of length {top} fit in no group of {spec.sp_sizes}")
        size[bucket == b] = k
        per_seq[bucket == b] = times[k] / k
        batch[int(b)] = _largest(lambda n: _fits_somehow(spec, [top] * n, "packed", sp=k), 1, 64)
    return _sized_plan(
        lens, size.tolist(), per_seq, lambda k, ids: _buckets_in_batches(ids, bucket, batch), spec, "dcp_bucket"
    )


def _buckets_in_batches(ids: list[int], bucket: np.ndarray, batch: dict[int, int]) -> list[list[int]]:
    """A group's sequences, bucket by bucket, in micro-batches of the bucket's batch size."""
    out = []
    for b in sorted({int(bucket[i]) for i in ids}, reverse=True):
        members = [i for i in ids if bucket[i] == b]
        out += [members[j : j + batch[b]] for j in range(0, len(members), batch[b])]
    return out


def _sized_plan(
    lens: np.ndarray,
    size: Sequence[int],
    work: np.ndarray,
    cut: Callable[[int, list[int]], list[list[int]]],
    spec: PlannerSpec,
    method: str,
) -> StepPlan:
    """A size per sequence: columns shared out by each size's work (times its size), sequences of a
    size spread over its groups by work (largest first onto the least loaded), each group's cut
    into micro-batches by ``cut``, one recompute mode for the step, plain 1F1B in order."""
    size = list(size)
    present = sorted(set(size), reverse=True)
    while sum(present) > spec.dp and len(present) > 1:  # too few columns for a group of each: promote the smallest
        small, up = present[-1], present[-2]
        size = [up if k == small else k for k in size]
        present.pop()
    if sum(present) > spec.dp:
        raise InfeasibleError(f"{method}: a group of {present[0]} needs more than the {spec.dp} columns")
    load = {k: float(sum(w * k for w, s in zip(work, size) if s == k)) for k in present}
    columns = {k: k for k in present}
    while sum(columns.values()) < spec.dp:
        left = spec.dp - sum(columns.values())
        k = max((k for k in present if k <= left), key=lambda k: (load[k] / columns[k], k))
        columns[k] += k
    grouping = [k for k in present for _ in range(columns[k] // k)]
    loads = [0.0] * len(grouping)
    members: list[list[int]] = [[] for _ in grouping]
    for i in sorted(range(len(lens)), key=lambda i: (-work[i], i)):
        g = min((g for g, k in enumerate(grouping) if k == size[i]), key=lambda g: (loads[g], g))
        loads[g] += work[i]
        members[g].append(i)
    if any(not m for m in members):
        raise InfeasibleError(f"{method}: {len(lens)} sequences leave a group of {grouping} without work")
    cuts = [(k, cut(k, ids)) for k, ids in zip(grouping, members)]
    flat = [row for _, rows in cuts for row in rows]
    priced = iter(_uniform(flat, lens, spec, "packed", method, sp=[k for k, rows in cuts for _ in rows]))
    replicas = [
        schedule_replica([next(priced) for _ in rows], spec=spec, first=first, size=k, adaptive=False)
        for (k, rows), first in zip(cuts, aligned_firsts(grouping))
    ]
    return StepPlan(method, "packed", tuple(replicas), spec.update_ms)


@dataclass(frozen=True)
class Baseline:
    """A baseline: ``plan(lengths, *, spec, max_len)`` plans one global batch as that system would;
    ``sequence_parallel``: it splits sequences over groups of data-parallel columns."""

    plan: Callable[..., StepPlan]
    sequence_parallel: bool = False


# Every baseline, by name: adding one is one entry. The names the config's microbatching.method
# accepts are the plugin's own "dynapipe" and the others here (methods.py; tests/test_config.py checks).
REGISTRY: dict[str, Baseline] = {
    "fixed_padding": Baseline(lambda lengths, *, spec, max_len: fixed_padding(lengths, spec, max_len)),
    "token_budget": Baseline(lambda lengths, *, spec, max_len: token_budget(lengths, spec)),
    "packing_full": Baseline(lambda lengths, *, spec, max_len: packing(lengths, spec, max_len, varlen=False)),
    "packing_varlen": Baseline(lambda lengths, *, spec, max_len: packing(lengths, spec, max_len, varlen=True)),
    "fixed_sp": Baseline(lambda lengths, *, spec, max_len: fixed_sp(lengths, spec), sequence_parallel=True),
    "fixed_sp_smallest": Baseline(
        lambda lengths, *, spec, max_len: fixed_sp(lengths, spec, tuned=False), sequence_parallel=True
    ),
    "megatron_hybrid_cp": Baseline(
        lambda lengths, *, spec, max_len: megatron_hybrid_cp(lengths, spec), sequence_parallel=True
    ),
    "dcp_bucket": Baseline(lambda lengths, *, spec, max_len: dcp_bucket(lengths, spec), sequence_parallel=True),
}
BASELINES = tuple(name for name, b in REGISTRY.items() if not b.sequence_parallel)
SP_BASELINES = tuple(name for name, b in REGISTRY.items() if b.sequence_parallel)


def plan_baseline(name: str, lengths: Sequence[int], spec: PlannerSpec, max_len: int) -> StepPlan:
    """Baseline ``name``'s plan of one global batch (``max_len``: the longest sequence accepted)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown baseline {name!r}; known: {', '.join(REGISTRY)}")
    return REGISTRY[name].plan(lengths, spec=spec, max_len=max_len)
