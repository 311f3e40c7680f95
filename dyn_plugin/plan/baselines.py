"""What existing systems do with the same global batch, priced and simulated like the planner.

- ``fixed_padding``: Megatron's default: a fixed number of sequences per micro-batch, each
  padded to the maximum sequence length.
- ``token_budget``: DeepSpeed's ``batch_by_seqlens``: sequences in loader order fill a micro-batch
  while their summed lengths stay within a token budget; each micro-batch is padded to its
  longest (pipelines need one shape per micro-batch).
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
from ..lengths.packing import pack_rows
from .assign import split_for_replicas
from .microbatch import InfeasibleError
from .planner import PlannerSpec, StepPlan, make_micro_batch, schedule_replicas, usable
from .types import MicroBatch


def _uniform(groups: list[list[int]], lengths: Sequence[int], spec: PlannerSpec, layout: Layout,
             method: str) -> list[MicroBatch]:
    """Price the groups with the cheapest recompute mode in which all of them fit."""
    for rc in spec.recomputes:
        try:
            mbs = [make_micro_batch(g, lengths, spec, layout, rc) for g in groups]
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


def _fits_somehow(spec: PlannerSpec, lens: list[int], layout: Layout) -> bool:
    for rc in spec.recomputes:
        if usable(make_micro_batch(range(len(lens)), lens, spec, layout, rc), spec):
            return True
    return False


def fixed_padding(lengths: Sequence[int], spec: PlannerSpec, max_len: int) -> StepPlan:
    n = _largest(lambda k: _fits_somehow(spec, [max_len] * k, "padded"), 1, len(lengths))
    if n == 0:
        raise InfeasibleError(f"fixed_padding: one sequence padded to {max_len} does not fit")
    groups = split_for_replicas([list(range(i, min(i + n, len(lengths)))) for i in range(0, len(lengths), n)],
                                lengths, spec.dp, equal_counts=False)
    padded = [max_len] * len(lengths)  # every sequence padded to max_len, not to its micro-batch's longest
    mbs = _uniform(groups, padded, spec, "padded", "fixed_padding")
    return schedule_replicas([_relabel(mb, g, lengths) for mb, g in zip(mbs, groups)], spec,
                             method="fixed_padding", balance=False, adaptive=False)


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
        try:
            _uniform(groups_for(budget, cap), lengths, spec, "padded", "token_budget")
            return True
        except InfeasibleError:
            return False

    for cap in (None, 8, 4, 2, 1):
        budget = _largest(lambda b: fits(b, cap), max(lengths), sum(lengths))
        if budget:
            mbs = _uniform(groups_for(budget, cap), lengths, spec, "padded", "token_budget")
            return schedule_replicas(mbs, spec, method="token_budget", balance=False, adaptive=False)
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
