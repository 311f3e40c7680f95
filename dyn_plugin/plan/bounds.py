"""Bounds on a step no plan can beat, to measure plans against: the sequences' own work spread
perfectly over every device (``ideal_ms``), and the longest sequence's path through the
pipeline (``critical_path_ms``)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .pricing import make_micro_batch
from .pyramid import fewest_checkpointed_alone
from .spec import PlannerSpec


def ideal_ms(lengths: Sequence[int], spec: PlannerSpec) -> float:
    """The sequences' own work spread perfectly: per sequence its token and attention cost over
    the whole model (no padding, no recompute, no fixed per-micro-batch cost), over pp*dp devices,
    plus the update every plan pays."""
    table = spec.cost.table("packed", "none", spec.tp)
    arr = np.asarray(lengths, dtype=float)
    total = 0.0
    counts = {"embedding": 1, "layer": spec.cost.num_layers, "head": 1}
    for comp, k in counts.items():
        for metric in ("forward_ms", "backward_ms"):
            _, c1, c2 = table.fits[comp][metric].coef
            total += k * float(np.sum(c1 * arr + c2 * arr * arr))
    return total / (spec.pp * spec.dp) + spec.update_ms


def critical_path_ms(lengths: Sequence[int], spec: PlannerSpec) -> float:
    """A lower bound no plan can beat: the longest sequence alone, in the cheapest recompute mode
    and group size it fits in (with pyramid checkpointing: on the fewest layers it fits with), must
    still pass forward through every stage and backward through every stage, and the update follows."""
    longest = int(max(lengths))
    best = float("inf")
    for layout, rc, sp in ((l, r, k) for l in spec.layouts for r in spec.recomputes for k in spec.sp_sizes):
        mb = make_micro_batch([0], [longest], spec=spec, layout=layout, recompute=rc, sp=sp)
        if all(p <= m.budget for p, m in zip(mb.peak_bytes, spec.memory)):
            if spec.pyramid:  # alone, it may keep some layers' activations
                mb = fewest_checkpointed_alone(mb, spec)
            hops = 2 * (spec.pp - 1) * spec.link.transfer_ms(mb.activation_bytes)
            best = min(best, sum(mb.forward_ms) + sum(mb.backward_ms) + hops)
    return best + spec.update_ms
