"""Parallel schemes: one pipeline's layout of tensor, pipeline and sequence parallelism, priced.

A scheme ``(tp, pp, sp)`` is one pipeline of ``pp`` stages of ``tp`` tensor-parallel ranks,
every row split over ``sp`` data-parallel columns (a sequence-parallel group, groups.py). A
strategy runs several pipelines side by side, each of its own scheme; per scheme, planning sees
one pipeline (``scheme_spec``: dp = 1, its stages, its tp, one group size) whose model states are
ZeRO-sharded over the whole cluster's data-parallel ranks. ``SchemeCost`` holds what strategy
proposal and stage 1 need from it: the longest sequence it can hold (from the memory model,
per recompute mode), each sequence's marginal time on it and the fixed cost of a micro-batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from ...config import DynPluginConfig
from ...cost.model import Layout
from ...cost.sequence_parallel import attention_kind
from ...cost.table import TableCostModel
from ..sequence_parallel.groups import SizeLimits, sequence_ms
from ..steps.pricing import make_micro_batch, usable
from ..steps.spec import PlannerSpec, planner_spec

logger = logging.getLogger(__name__)

DEGREES = (1, 2, 4, 8)  # the measured A100 tables carry tp 1-8; pipelines and groups alike


@dataclass(frozen=True)
class Scheme:
    """One pipeline: ``pp`` stages of ``tp`` tensor-parallel ranks, every row split over ``sp``
    data-parallel columns (a sequence-parallel group)."""

    tp: int = 1
    pp: int = 1
    sp: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.sp

    @property
    def name(self) -> str:
        return f"tp{self.tp}pp{self.pp}sp{self.sp}"

    def to_json(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "sp": self.sp}

    @classmethod
    def from_json(cls, d: dict) -> "Scheme":
        return cls(int(d["tp"]), int(d["pp"]), int(d["sp"]))


def scheme_spec(
    cost: TableCostModel, config: DynPluginConfig, scheme: Scheme, *, gpus: int, zero_stage: int = 1
) -> PlannerSpec:
    """One pipeline of ``scheme`` on a cluster of ``gpus``: model states and the update are those
    of ZeRO-``zero_stage`` over the cluster's gpus / (tp * pp) data-parallel ranks; the spec plans
    one pipeline (dp = 1) at group size ``scheme.sp``. The stage split is balanced (the config's
    ``layers_per_stage`` is for its own pipeline depth); the spec's cost model counts the heads
    of one tensor-parallel rank, the ones sequence parallelism splits. Raises ValueError naming
    the scheme and what to change where it cannot run."""
    tp, pp, sp = scheme.tp, scheme.pp, scheme.sp
    what = f"scheme {scheme.name} ({cost.name}, {gpus} GPUs)"
    if min(tp, pp, sp) < 1 or gpus % scheme.gpus:
        raise ValueError(
            f"{what}: its {scheme.gpus} GPUs must divide the cluster's {gpus}; pick degrees whose product divides it"
        )
    heads, kv = cost.num_heads, cost.num_kv_heads or cost.num_heads
    if not heads:
        raise ValueError(f"{what}: the cost model does not know the attention heads; set num_heads")
    measured = sorted({t for _, _, t in cost.tables})
    if tp not in measured:
        raise ValueError(f"{what}: the cost model has no tables at tp={tp}; use tp in {measured}")
    if heads % tp or kv % tp:
        raise ValueError(
            f"{what}: tensor parallelism splits the heads, and {heads} query / {kv} key-value heads do "
            f"not divide by tp={tp}; use a tp dividing both"
        )
    if pp > cost.num_layers:
        raise ValueError(
            f"{what}: {cost.num_layers} layers cannot fill {pp} pipeline stages; use pp <= {cost.num_layers}"
        )
    if sp & (sp - 1):
        raise ValueError(
            f"{what}: sequence-parallel groups are aligned blocks of a power of two columns; use sp 1, 2, 4, ..."
        )
    try:  # a tensor-parallel rank holds heads / tp of them: those are what Ulysses splits over the group
        attention_kind(sp, config.sequence_parallel.attention, heads // tp, kv // tp)
    except ValueError as exc:
        raise ValueError(f"{what}, heads per tensor-parallel rank: {exc}") from None
    cfg = config.model_copy(
        update={
            "pipeline": config.pipeline.model_copy(update={"stages": pp, "layers_per_stage": None}),
            "sequence_parallel": config.sequence_parallel.model_copy(update={"sizes": [sp]}),
        }
    )
    try:
        spec = planner_spec(
            replace(cost, num_heads=heads // tp, num_kv_heads=kv // tp),
            cfg,
            dp=gpus // (tp * pp),
            zero_stage=zero_stage,
            tp=tp,
        )
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}; or a scheme of larger tp or pp (both split the model states)") from None
    return replace(spec, dp=1, sp_sizes=(sp,))


@dataclass(frozen=True)
class SchemeCost:
    """A scheme's pricing on one cluster. ``by_mode``: per recompute mode, the longest sequence
    (up to ``microbatching.max_seq_len``) that fits alone in a micro-batch of ``layout`` (0: none)."""

    scheme: Scheme
    spec: PlannerSpec
    by_mode: dict[str, int]
    layout: Layout = "packed"

    @property
    def longest(self) -> int:
        return max(self.by_mode.values())

    @property
    def update_ms(self) -> float:
        return self.spec.update_ms

    @property
    def fixed_ms(self) -> float:
        """What a micro-batch costs whatever it holds, in the first recompute mode (none, where
        allowed: the mode short sequences run in): the slowest stage's forward + backward of the
        tables' constants and of the attention collectives' latencies. A micro-batch whose
        kernels are so small that a table's floor binds costs more than this plus its sequences'
        ``sequence_ms``."""
        return self.fixed_by_mode[self.spec.recomputes[0]]

    @property
    def fixed_by_mode(self) -> dict[str, float]:
        return {rc: self._fixed(rc) for rc in self.spec.recomputes}

    def _fixed(self, rc: str) -> float:
        spec = self.spec
        table = spec.cost.table(self.layout, rc, spec.tp)
        comm, rerun = spec.layer_comm(self.scheme.sp, "none"), spec.layer_comm(self.scheme.sp, rc)
        worst = 0.0
        for stage in spec.stages:
            counts = {"embedding": int(stage.first), "layer": stage.num_layers, "head": int(stage.last)}
            t = sum(
                n * table.fits[comp][m].coef[0] for comp, n in counts.items() for m in ("forward_ms", "backward_ms")
            )
            worst = max(worst, t + stage.num_layers * (comm.forward[0] + rerun.backward[0]))
        return worst

    def sequence_ms(self, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        """Per sequence, the slowest stage's marginal forward + backward in the first recompute
        mode it fits in alone (``plan.groups.sequence_ms``), inf beyond ``longest``."""
        limits = SizeLimits((self.scheme.sp,), {(self.scheme.sp, rc): n for rc, n in self.by_mode.items()})
        return sequence_ms(np.asarray(lengths, dtype=np.int64), self.scheme.sp, self.spec, self.layout, limits)


def longest_alone(spec: PlannerSpec, layout: Layout, recompute: str, sp: int, max_len: int) -> int:
    """The longest length in 1..``max_len`` that fits alone (``usable``); 0 if none. Memory only grows
    with length, so a binary search."""
    lo, hi = 0, max_len  # lo fits (or is 0); nothing beyond hi does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if usable(make_micro_batch([0], [mid], spec=spec, layout=layout, recompute=recompute, sp=sp), spec):
            lo = mid
        else:
            hi = mid - 1
    return lo


def scheme_cost(spec: PlannerSpec, scheme: Scheme, max_len: int) -> SchemeCost:
    """``scheme`` priced on its ``scheme_spec``: per recompute mode, the longest sequence up to ``max_len``."""
    layout: Layout = "packed" if "packed" in spec.layouts else spec.layouts[0]  # a sequence alone packs unpadded
    return SchemeCost(
        scheme, spec, {rc: longest_alone(spec, layout, rc, scheme.sp, max_len) for rc in spec.recomputes}, layout
    )


def scheme_costs(
    cost: TableCostModel,
    config: DynPluginConfig,
    *,
    gpus: int,
    zero_stage: int = 1,
    tps: Sequence[int] = DEGREES,
    pps: Sequence[int] = DEGREES,
    sps: Sequence[int] = DEGREES,
) -> list[SchemeCost]:
    """Every scheme of the given degrees that divides ``gpus``, can hold its model states and fits
    some sequence, in (tp, pp, sp) order; the others are skipped (logged at debug level)."""
    out = []
    for tp in sorted(set(tps)):
        for pp in sorted(set(pps)):
            for sp in sorted(set(sps)):
                scheme = Scheme(tp, pp, sp)
                if gpus % scheme.gpus:
                    continue
                try:
                    spec = scheme_spec(cost, config, scheme, gpus=gpus, zero_stage=zero_stage)
                except ValueError as exc:
                    logger.debug("skipped: %s", exc)
                    continue
                priced = scheme_cost(spec, scheme, config.microbatching.max_seq_len)
                if priced.longest == 0:
                    logger.debug("skipped: scheme %s holds no sequence alone within its memory", scheme.name)
                    continue
                out.append(priced)
    return out
