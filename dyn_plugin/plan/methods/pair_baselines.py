"""What existing systems do with a global batch of (input, target) pairs, priced and simulated
like the pair planner (the encoder-decoder twins of baselines.py):

- ``pair_padding``: Megatron's T5 default: a fixed number of pairs per micro-batch, every input
  padded to the maximum input length and every target to the maximum target length;
- ``pair_packing``: fixed-length packing per side, pairs kept together (T5's packing): first-fit
  decreasing (by input, then target) into rows bounded by both maxima, a fixed number of rows per
  micro-batch, each row priced as a padded pair of the maxima (whole-row attention); a micro-batch
  lists its pairs row by row, and its rows are those ``packed_pair_shape`` reads back from that
  order, which the runtime builds;
- ``pair_token_budget``: pairs in loader order fill a micro-batch while their input + target
  tokens stay within a budget (DynaPipe's token-based baseline), each micro-batch padded to its
  longest input and longest target.

As in baselines.py each uses one recompute mode for the whole step, the cheapest in which every
micro-batch fits, micro-batches go to replicas round-robin and every pipeline runs plain 1F1B in
loader order. The size a user would tune (pairs or rows per micro-batch, token budget) is tuned
here: every power of two up to the largest that fits, and that largest, are simulated and the
fastest step kept.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ...cost.encoder_decoder import packed_pair_shape
from ...cost.model import round_up
from ...lengths.packing import pack_pair_rows
from ..steps.assign import split_for_replicas
from ..steps.microbatch import InfeasibleError
from ..steps.pair_microbatch import check_pairs, price_pair_groups
from ..steps.pair_spec import PairSpec
from ..steps.pricing import usable
from ..steps.replicas import schedule_replicas
from ..steps.types import PairMicroBatch, StepPlan


def _uniform(
    groups: Sequence[Sequence[int]],
    inputs: np.ndarray,
    targets: np.ndarray,
    spec: PairSpec,
    *,
    padded_to: tuple[int, int] | None = None,
    rows: Sequence[int] | None = None,
) -> list[PairMicroBatch] | None:
    """The groups priced in the cheapest recompute mode in which all of them fit; None if none."""
    for rc in spec.recomputes:
        mbs = price_pair_groups(groups, inputs, targets, [rc] * len(groups), spec=spec, padded_to=padded_to, rows=rows)
        if all(usable(mb, spec) for mb in mbs):
            return mbs
    return None


def _tuned(
    sizes_that_fit: Callable[[int], list[PairMicroBatch] | None], upper: int, spec: PairSpec, method: str
) -> StepPlan:
    """The fastest plan over sizes: powers of two up to the largest that fits (binary search:
    fitting shrinks as sizes grow) and that largest, each simulated as the host runs it."""
    if sizes_that_fit(1) is None:
        raise InfeasibleError(f"{method}: not even the smallest size fits in any recompute mode")
    lo, hi = 1, max(1, upper)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if sizes_that_fit(mid) is not None else (lo, mid - 1)
    plans = []
    for k in sorted({1 << b for b in range(lo.bit_length()) if 1 << b <= lo} | {lo}):
        # fitting is not quite monotone in the size (groups split for the replicas differ): skip a size that does not
        mbs = sizes_that_fit(k)
        if mbs is not None:
            plans.append(schedule_replicas(mbs, spec=spec, method=method, balance=False, adaptive=False))
    return min(plans, key=lambda p: p.iteration_ms)


def _chunks(items: Sequence[int], size: int) -> list[list[int]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def _widths(max_input: int, max_target: int, enc: np.ndarray, dec: np.ndarray, spec: PairSpec, method: str):
    if enc.max() > max_input or dec.max() > max_target:
        raise ValueError(f"{method}: a pair is longer than the maxima ({max_input}, {max_target})")
    return round_up(max_input, spec.cost.pad_multiple), round_up(max_target, spec.cost.pad_multiple)


def pair_padding(
    inputs: Sequence[int], targets: Sequence[int], spec: PairSpec, max_input: int, max_target: int
) -> StepPlan:
    enc, dec = check_pairs(inputs, targets)
    width = _widths(max_input, max_target, enc, dec, spec, "pair_padding")
    total = (enc + dec).tolist()

    def sized(k: int) -> list[PairMicroBatch] | None:
        # the host's sampler gives each rank its own pairs: the largest groups split until every rank has one
        groups = split_for_replicas(_chunks(range(len(enc)), k), total, spec.dp, equal_counts=False)
        return _uniform(groups, enc, dec, spec, padded_to=width)

    return _tuned(sized, len(enc), spec, "pair_padding")


def pair_packing(
    inputs: Sequence[int], targets: Sequence[int], spec: PairSpec, max_input: int, max_target: int
) -> StepPlan:
    enc, dec = check_pairs(inputs, targets)
    width = _widths(max_input, max_target, enc, dec, spec, "pair_packing")
    # fewer rows than replicas: the fullest rows split in two, as a host's sampler gives each rank its own
    # rows of the widths they are padded to: first fit's rows, listed in order, are next fit's within them
    rows = split_for_replicas(
        pack_pair_rows(np.stack([enc, dec], axis=1), *width),
        (enc + dec).tolist(),
        spec.dp,
        equal_counts=False,
    )
    row_tokens = [int(enc[r].sum() + dec[r].sum()) for r in rows]

    def sized(k: int) -> list[PairMicroBatch] | None:
        by_rows = split_for_replicas(_chunks(range(len(rows)), k), row_tokens, spec.dp, equal_counts=False)
        groups = [[i for r in g for i in rows[r]] for g in by_rows]
        # the rows the runtime builds (halves of a row split for the replicas may share one again)
        packed = [packed_pair_shape(enc[g], dec[g], width)[0] for g in groups]
        return _uniform(groups, enc, dec, spec, padded_to=width, rows=packed)

    return _tuned(sized, len(rows), spec, "pair_packing")


def budget_pair_groups(
    inputs: Sequence[int], targets: Sequence[int], budget: int, max_pairs: int | None = None
) -> list[list[int]]:
    """Pairs in loader order while input + target tokens stay within ``budget`` (a pair over it
    alone) and, with ``max_pairs``, their count within it."""
    groups: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, (a, b) in enumerate(zip(inputs, targets)):
        if cur and (total + a + b > budget or len(cur) == max_pairs):
            groups.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += int(a) + int(b)
    return groups + [cur] if cur else groups


def pair_token_budget(inputs: Sequence[int], targets: Sequence[int], spec: PairSpec) -> StepPlan:
    """Budgets of the longest pair's tokens times 1, 2, 4, ... up to the largest multiple that fits;
    where not even the longest pair's budget fits (a long input and a long target from two pairs
    padded together), the pairs per micro-batch are capped too (8, 4, 2, 1), as ``max_batch_size``
    lets a user do (``baselines.token_budget``)."""
    enc, dec = check_pairs(inputs, targets)
    total = (enc + dec).tolist()
    longest = int(max(total))
    for cap in (None, 8, 4, 2, 1):

        def sized(scale: int, cap: int | None = cap) -> list[PairMicroBatch] | None:
            groups = budget_pair_groups(enc, dec, longest * scale, cap)
            return _uniform(split_for_replicas(groups, total, spec.dp, equal_counts=False), enc, dec, spec)

        if sized(1) is not None:
            return _tuned(sized, max(1, sum(total) // longest), spec, "pair_token_budget")
    raise InfeasibleError("pair_token_budget: a pair alone fits in no recompute mode")


# Every pair baseline, by name: (inputs, targets, spec, max_input, max_target) -> its plan.
PAIR_BASELINES: dict[str, Callable[..., StepPlan]] = {
    "pair_padding": pair_padding,
    "pair_packing": pair_packing,
    "pair_token_budget": lambda inputs, targets, spec, max_input, max_target: pair_token_budget(inputs, targets, spec),
}
