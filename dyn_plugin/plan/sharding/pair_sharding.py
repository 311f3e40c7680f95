"""What the sharding search (sharding.py) needs of a step of (input, target) pairs: the pair
planner's plan of a typical global batch under a sharding plan's model states, and the least
activation memory any plan of the run needs.

An encoder-decoder's units are priced per side (``ShardUnit.component`` "encoder" or "decoder"):
per micro-batch index, the slowest rank's micro-batch gives one encoder layer's and one decoder
layer's time (the cost model's layers at that micro-batch's padded shape and recompute mode) and
the head's, the rest of the priced stage; the T5 tables price no embedding time.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...config import DynPluginConfig
from ...cost.encoder_decoder import EncoderDecoderCostModel, PairStage, pair_shape
from ..steps.pair_planner import plan_pairs
from ..steps.pair_spec import PairSpec, pair_planner_spec

PAIR_COMPONENTS = ("embedding", "encoder", "decoder", "head")
_ENCODER, _DECODER = PairStage(encoder_layers=1), PairStage(decoder_layers=1)


def pair_step(
    pairs: Sequence[tuple[int, int]],
    cost: EncoderDecoderCostModel,
    config: DynPluginConfig,
    *,
    world: int,
    state_bytes: float,
) -> tuple[int, float, float, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Plan ``pairs`` (one global batch) on ``world`` ranks with ``state_bytes`` of model states per
    rank, as the loader will (``pair_planner_spec(state_bytes=...)``: ZeRO-3's rules). Returns
    (micro-batches per rank, activation peak, compute ms, (forward, backward) ms per component and
    micro-batch index): ``sharding.TypicalStep``'s fields."""
    spec = pair_planner_spec(cost, config, dp=world, zero_stage=3, state_bytes=state_bytes)
    inputs, targets = (list(side) for side in zip(*pairs))
    plan = plan_pairs(inputs, targets, spec)
    runs = [[r.micro_batches[i] for i in r.schedule.order] for r in plan.replicas]
    count = len(runs[0])
    # every rank gathers each unit together, so at each micro-batch index the slowest rank sets the pace
    slowest = [max((run[j] for run in runs), key=lambda mb: mb.time_ms) for j in range(count)]
    comp = {c: (np.zeros(count), np.zeros(count)) for c in PAIR_COMPONENTS}
    for j, mb in enumerate(slowest):
        (n, se), (_, sd) = mb.shape, mb.target_shape
        enc = cost.stage_costs(_ENCODER, n, se, sd, recompute=mb.recompute, tp=spec.tp)
        dec = cost.stage_costs(_DECODER, n, se, sd, recompute=mb.recompute, tp=spec.tp)
        for part, total in ((0, mb.forward_ms[0]), (1, mb.backward_ms[0])):
            e, d = float(enc[part]), float(dec[part])
            comp["encoder"][part][j], comp["decoder"][part][j] = e, d
            comp["head"][part][j] = max(total - cost.encoder_layers * e - cost.decoder_layers * d, 0.0)
    return count, plan.peak_bytes, sum(mb.time_ms for mb in slowest), comp


def pair_least_activation(longest: tuple[int, int], spec: PairSpec) -> float:
    """The least activation peak of the run's longest input with its longest target alone (no pair
    is longer on either side), in the recompute mode that keeps the least."""
    n, se, sd = pair_shape([longest[0]], [longest[1]], spec.cost.pad_multiple)
    stage = spec.stages[0]
    peaks = [
        float(spec.cost.stage_costs(stage, n, se, sd, recompute=rc, tp=spec.tp)[3])
        for rc in spec.recomputes
        if bool(spec.cost.table(rc, spec.tp).covers(n, se, sd))
    ]
    if not peaks:
        raise ValueError(
            f"the longest input ({longest[0]} tokens) with the longest target ({longest[1]}) is beyond what cost "
            f"model {spec.cost.name!r} measured; cap the lengths (microbatching.max_seq_len) or measure longer pairs"
        )
    return min(peaks)


__all__ = ["PAIR_COMPONENTS", "pair_least_activation", "pair_step"]
