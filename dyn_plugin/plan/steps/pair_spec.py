"""The planner's spec for an encoder-decoder model: encoder stages then decoder stages.

Megatron splits a T5 pipeline at ``pipeline_model_parallel_split_rank``: stages before it run
encoder layers, the others decoder layers, each side's layers spread evenly over its stages
(earlier stages take the remainder); with one stage (pp = 1, data parallel only) it holds both.
``pair_planner_spec`` builds a :class:`PairSpec` from the
plugin config and an :class:`EncoderDecoderCostModel` as ``planner_spec`` does for decoder-only
models: each stage's activation budget after its model states, 1F1B's in-flight count, the link,
the recompute modes, the update; the split is the caller's or the one whose slowest stage is
fastest on a reference micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...checks import MAX_RANKS, check_count
from ...config import DynPluginConfig
from ...cost.encoder_decoder import EncoderDecoderCostModel, PairStage
from ...cost.model import RECOMPUTES, Recompute, split_layers
from .spec import StepSpec, step_fields


@dataclass(frozen=True, kw_only=True)
class PairSpec(StepSpec):
    """Everything the planner of an encoder-decoder's (input, target) pairs knows, for one step: its
    stages hold encoder layers, then decoder layers."""

    cost: EncoderDecoderCostModel
    stages: tuple[PairStage, ...]

    @property
    def split_rank(self) -> int:
        """The first stage with decoder layers (Megatron's pipeline_model_parallel_split_rank; 0 for one stage)."""
        return next(i for i, s in enumerate(self.stages) if s.decoder_layers)


def split_stages(cost: EncoderDecoderCostModel, pp: int, split_rank: int) -> tuple[PairStage, ...]:
    """``split_rank`` encoder stages then ``pp - split_rank`` decoder stages, each side's layers
    evenly spread (earlier stages take the remainder); one stage (pp = 1, split rank 0) holds both."""
    if pp == 1 and split_rank == 0:
        return (PairStage(cost.encoder_layers, cost.decoder_layers, embedding=True, last=True),)
    if not 1 <= split_rank < pp:
        raise ValueError(
            f"pipeline split rank must leave encoder and decoder stages: 1 <= split_rank < {pp} stages, got {split_rank}"
        )
    if split_rank > cost.encoder_layers or pp - split_rank > cost.decoder_layers:
        raise ValueError(
            f"cannot split {cost.encoder_layers} encoder and {cost.decoder_layers} decoder layers over "
            f"{split_rank} encoder and {pp - split_rank} decoder stages"
        )
    enc = split_layers(cost.encoder_layers, split_rank)
    dec = split_layers(cost.decoder_layers, pp - split_rank)
    return tuple(PairStage(encoder_layers=s.num_layers, embedding=s.first) for s in enc) + tuple(
        PairStage(decoder_layers=s.num_layers, embedding=s.first, last=s.last) for s in dec
    )


def balanced_split_rank(
    cost: EncoderDecoderCostModel,
    pp: int,
    *,
    reference: tuple[int, int, int],
    tp: int = 1,
    recompute: Recompute = "none",
) -> int:
    """The split whose slowest stage is fastest on ``reference`` = (pairs, input length, target
    length), priced without recompute: decoder layers cost more than encoder layers (cross-attention),
    and by how much depends on the lengths, so the split follows the data."""
    n, se, sd = reference
    if pp == 1:
        return 0
    best, best_t = None, np.inf
    for k in range(1, pp):
        try:
            stages = split_stages(cost, pp, k)
        except ValueError:
            continue
        t = max(float(sum(cost.stage_costs(s, n, se, sd, recompute=recompute, tp=tp)[:2])) for s in stages)
        if t < best_t:
            best, best_t = k, t
    if best is None:
        raise ValueError(f"no split of {cost.encoder_layers} + {cost.decoder_layers} layers over {pp} stages")
    return best


def pair_planner_spec(
    cost: EncoderDecoderCostModel,
    config: DynPluginConfig,
    *,
    dp: int,
    zero_stage: int = 0,
    tp: int = 1,
    split_rank: int | None = None,
    reference: tuple[int, int, int] = (8, 512, 128),
    seed: int = 0,
    state_bytes: float | None = None,
) -> PairSpec:
    """The spec from the plugin config, as ``planner_spec`` builds it for decoder-only models.
    ``split_rank``: the first decoder stage (None: :func:`balanced_split_rank` on ``reference``; 0
    for one stage). ``state_bytes``: a sharding plan's model states per rank, in place of ZeRO's,
    as ``planner_spec`` takes them: one stage, activations get ``sharding.memory_budget_mb`` (else
    the device's memory) minus them, and ZeRO-3's rules (the same recompute per micro-batch index)."""
    check_count("dp", dp, high=MAX_RANKS)
    check_count("tp", tp, high=MAX_RANKS)
    pipe, mb = config.pipeline, config.microbatching
    if pipe.layers_per_stage:
        raise ValueError(
            "pipeline.layers_per_stage is for decoder-only models; an encoder-decoder pipeline is split by "
            "its split rank (encoder stages, then decoder stages, each side even)"
        )
    if mb.layout not in ("auto", "padded"):
        raise ValueError(
            f"microbatching.layout={mb.layout!r}: the encoder-decoder planner prices its micro-batches padded per "
            "side only; rows packed with several pairs per side are the baseline microbatching.method 'packing_full'"
        )
    if mb.pad_multiple != cost.pad_multiple:
        raise ValueError(
            f"microbatching.pad_multiple={mb.pad_multiple} but the cost model pads to {cost.pad_multiple}; "
            "import the tables with the same pad_multiple"
        )
    recomputes = tuple(r for r in (RECOMPUTES if mb.recompute == "auto" else (mb.recompute,)) if (r, tp) in cost.tables)
    if not recomputes:
        have = ", ".join(f"{r}/tp{t}" for r, t in sorted(cost.tables))
        raise ValueError(f"cost model {cost.name!r} cannot price recompute={mb.recompute!r} at tp={tp} (it has {have})")
    if split_rank is None:
        split_rank = balanced_split_rank(cost, pipe.stages, reference=reference, tp=tp)
    stages = split_stages(cost, pipe.stages, split_rank)
    shared = step_fields(cost, config, stages, zero_stage=zero_stage, dp=dp, tp=tp, seed=seed, state_bytes=state_bytes)
    return PairSpec(**shared, recomputes=recomputes)
