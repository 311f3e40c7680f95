"""What existing systems do with the same global batch, priced and simulated like the planner.

- ``fixed_padding``: Megatron's default: a fixed number of sequences per micro-batch, each
  padded to the maximum sequence length.
- ``token_budget``: DeepSpeed's ``batch_by_seqlens``: sequences in loader order fill a micro-batch
  up to a token budget, padded to the micro-batch's longest (pipelines need one shape per
  micro-batch).
- ``packing_full``: fixed-length packing (first-fit decreasing into rows of the maximum length),
  attention over the whole row: Megatron's packing, the baseline DynaPipe beat.
- ``packing_varlen``: the same rows with per-document attention: the strongest baseline.

Each uses one recompute mode for the whole step, the cheapest in which every micro-batch fits,
as a user would configure it; micro-batches go to replicas round-robin and every pipeline runs
plain 1F1B in loader order, as the host frameworks do. Sizes (sequences per micro-batch, token
budget, rows per micro-batch) are the largest that fit memory: the baselines at their best.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from ..cost.model import Layout
from .microbatch import InfeasibleError
from .packing import pack_rows
from .planner import PlannerSpec, StepPlan, make_micro_batch, schedule_replicas, usable
from .types import MicroBatch


def _enough_for_replicas(groups: list[list[int]], dp: int) -> list[list[int]]:
    """Split the largest groups until every replica can get one: a host framework's sampler
    gives each rank its own sequences, so no rank sits a step out."""
    groups = [list(g) for g in groups]
    while len(groups) < dp:
        big = max((g for g in groups if len(g) > 1), key=len, default=None)
        if big is None:
            raise ValueError(f"{sum(map(len, groups))} sequences cannot give each of {dp} replicas a micro-batch")
        groups.remove(big)
        groups += [big[0::2], big[1::2]]
    return groups


def _uniform(groups: list[list[int]], lengths: Sequence[int], spec: PlannerSpec, layout: Layout,
             row_len: int | None, method: str) -> list[MicroBatch]:
    """Price the groups with the cheapest recompute mode in which all of them fit."""
    for rc in spec.recomputes:
        try:
            mbs = [make_micro_batch(g, lengths, spec, layout, rc, row_len) for g in groups]
        except ValueError:
            continue
        if all(usable(mb, spec) for mb in mbs):
            return mbs
    raise InfeasibleError(f"{method}: some micro-batch fits in no recompute mode")


def _largest(feasible: Callable[[int], bool], lower: int, upper: int) -> int:
    """Largest n in [lower, upper] with feasible(n) (0 if none), assuming feasibility shrinks as n grows."""
    if not feasible(lower):
        return 0
    lo, hi = lower, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if feasible(mid) else (lo, mid - 1)
    return lo


def _fits_somehow(spec: PlannerSpec, lens: list[int], layout: Layout, row_len: int | None = None) -> bool:
    for rc in spec.recomputes:
        if usable(make_micro_batch(range(len(lens)), lens, spec, layout, rc, row_len), spec):
            return True
    return False


def fixed_padding(lengths: Sequence[int], spec: PlannerSpec, max_len: int) -> StepPlan:
    n = _largest(lambda k: _fits_somehow(spec, [max_len] * k, "padded"), 1, len(lengths))
    if n == 0:
        raise InfeasibleError(f"fixed_padding: one sequence padded to {max_len} does not fit")
    groups = _enough_for_replicas([list(range(i, min(i + n, len(lengths)))) for i in range(0, len(lengths), n)], spec.dp)
    padded = [max_len] * len(lengths)  # every sequence padded to max_len, not to its micro-batch's longest
    mbs = _uniform(groups, padded, spec, "padded", None, "fixed_padding")
    return schedule_replicas([_relabel(mb, g, lengths) for mb, g in zip(mbs, groups)], spec,
                             method="fixed_padding", balance=False, adaptive=False)


def token_budget(lengths: Sequence[int], spec: PlannerSpec) -> StepPlan:
    def groups_for(budget: int) -> list[list[int]]:
        groups, cur, longest = [], [], 0
        for i, s in enumerate(lengths):
            if cur and (len(cur) + 1) * max(s, longest) > budget:
                groups.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, s)
        return _enough_for_replicas(groups + [cur], spec.dp)

    def fits(budget: int) -> bool:
        try:
            _uniform(groups_for(budget), lengths, spec, "padded", None, "token_budget")
            return True
        except InfeasibleError:
            return False

    # The largest budget whose micro-batches all fit: the value a user would tune max_tokens to.
    budget = _largest(fits, max(lengths), max(lengths) * len(lengths))
    if budget == 0:
        raise InfeasibleError("token_budget: the longest sequence alone does not fit")
    mbs = _uniform(groups_for(budget), lengths, spec, "padded", None, "token_budget")
    return schedule_replicas(mbs, spec, method="token_budget", balance=False, adaptive=False)


def packing(lengths: Sequence[int], spec: PlannerSpec, row_len: int, *, varlen: bool) -> StepPlan:
    method = "packing_varlen" if varlen else "packing_full"
    rows = _enough_for_replicas(pack_rows(lengths, row_len), spec.dp)
    if varlen:
        mbs = _uniform(rows, lengths, spec, "packed", row_len, method)
    else:
        # whole-row attention: priced as one padded row of row_len, whatever its documents
        priced = _uniform([[r] for r in range(len(rows))], [row_len] * len(rows), spec, "padded", None, method)
        mbs = [_relabel(mb, r, lengths) for mb, r in zip(priced, rows)]
    return schedule_replicas(mbs, spec, method=method, balance=False, adaptive=False)


def _relabel(mb: MicroBatch, sample_ids: Sequence[int], lengths: Sequence[int]) -> MicroBatch:
    """The same priced micro-batch, carrying the real samples it holds."""
    return replace(mb, sample_ids=tuple(sample_ids), seq_lens=tuple(int(lengths[i]) for i in sample_ids))


BASELINES = ("fixed_padding", "token_budget", "packing_full", "packing_varlen")


def plan_baseline(name: str, lengths: Sequence[int], spec: PlannerSpec, max_len: int) -> StepPlan:
    if name == "fixed_padding":
        return fixed_padding(lengths, spec, max_len)
    if name == "token_budget":
        return token_budget(lengths, spec)
    if name in ("packing_full", "packing_varlen"):
        return packing(lengths, spec, max_len, varlen=name == "packing_varlen")
    raise ValueError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)}")
