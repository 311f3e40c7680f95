"""The planner's spec: everything it knows about the model and the cluster for one step.

``planner_spec`` builds a :class:`PlannerSpec` from the plugin config and a cost model: the
pipeline stages (``balanced_split`` by default), each stage's activation budget after model
states, the links, and the layouts, recompute modes and sequence-parallel sizes allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...checks import MAX_RANKS, check_count
from ...config import DynPluginConfig
from ...cost.model import LAYOUTS, RECOMPUTES, Layout, Recompute, StageSpec, features, split_layers
from ...cost.sequence_parallel import LayerComm, attention_kind, group_sizes
from ...cost.table import TableCostModel, evaluate_stage
from .microbatch import StageMemory
from .types import LinkSpec

MB = 1 << 20
ACT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
PRICED_CACHE = 4096  # micro-batches a spec keeps priced (about 1 KiB each): a dozen steps of them


@dataclass(frozen=True, kw_only=True)
class StepSpec:
    """What every planner of a step knows of the cluster, whatever it plans (sequences or pairs):
    the pipeline's stages and each one's memory, the data-parallel and tensor-parallel degrees, the
    link between stages, the recompute modes the cost model prices, the schedule policy and the
    update after the last micro-batch."""

    stages: tuple
    memory: tuple[StageMemory, ...]
    dp: int
    link: LinkSpec
    recomputes: tuple[Recompute, ...] = RECOMPUTES
    tp: int = 1
    seed: int = 0
    schedule: str = "auto"  # pipeline.schedule: a name in schedule.SCHEDULES (auto, adaptive, 1f1b, zero_bubble)
    update_ms: float = 0.0  # gradient all-reduce + optimizer step after the last micro-batch
    same_recompute: bool = False  # every rank recomputes alike at each micro-batch of its run order (ZeRO-3)
    cap_in_flight: bool = True  # pipeline.cap_in_flight: the host runs a stage with fewer micro-batches in flight
    pyramid: bool = False  # checkpoint per micro-batch only as many layers as memory needs
    # per stage, a factor on the times priced for it (the online calibration's stage factors: a stage
    # that alone runs slower); () is 1 on every stage. The partition's DP prices without it: the
    # schedules, the simulation and every prediction see it
    stage_time: tuple[float, ...] = ()

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def split_backward(self) -> bool:
        """Whether schedules may split backwards into I and W (``pipeline.schedule: zero_bubble``):
        only then are micro-batches priced for it."""
        return self.schedule == "zero_bubble"


@dataclass(frozen=True, kw_only=True)
class PlannerSpec(StepSpec):
    """Everything the planner of a decoder-only model's sequences knows, for one step."""

    cost: TableCostModel
    stages: tuple[StageSpec, ...]
    hidden_size: int
    layouts: tuple[Layout, ...] = LAYOUTS
    row_len: int | None = None  # fixed-length packing rows (the max sequence length) tried as a candidate
    sp_sizes: tuple[int, ...] = (1,)  # sequence-parallel group sizes allowed ((1,) = DynaPipe alone)
    sp_attention: str = "auto"  # ulysses | ring | auto
    equal_counts: bool = False  # every rank runs the same number of micro-batches (ZeRO-2/3, or balance = intra)
    sp_link: tuple[LinkSpec, LinkSpec] = (LinkSpec(100.0), LinkSpec(12.5))  # inside a node, across nodes
    devices_per_node: int = 1

    def layer_comm(self, sp: int, recompute: Recompute) -> LayerComm:
        """Per layer, the attention collectives and buffers of a micro-batch split over ``sp`` ranks."""
        if sp <= 1:
            return LayerComm()
        key = (sp, recompute)
        if key not in self._comm:
            # a group's ranks are neighbouring columns of one stage: consecutive global ranks
            link = self.sp_link[0] if sp * self.tp <= self.devices_per_node else self.sp_link[1]
            kind = attention_kind(sp, self.sp_attention, self.cost.num_heads, self.cost.num_kv_heads)
            self._comm[key] = self.cost.collectives.layer(
                sp,
                kind,
                recompute,
                hidden=self.hidden_size // self.tp,
                kv_hidden=(self.cost.kv_hidden_size or self.hidden_size) // self.tp,
                # unknown heads: as many as 64-wide heads make, the most a common model has (the
                # ring's score blocks grow with the heads)
                heads=(self.cost.num_heads or self.hidden_size // 64) // self.tp,
                act_bytes=ACT_BYTES.get(self.cost.dtype, 2),
                link_gb_per_s=link.gb_per_s,
                latency_us=link.latency_us,
            )
        return self._comm[key]

    @property
    def priced(self) -> dict:
        """Micro-batches priced under this spec, by what their price depends on (``pricing.price_features``)."""
        return self._priced

    def remember_price(self, key: tuple, priced: Any) -> None:
        if len(self._priced) >= PRICED_CACHE:  # the oldest goes: a run's lengths recur, not its old steps
            del self._priced[next(iter(self._priced))]
        self._priced[key] = priced

    def __post_init__(self) -> None:
        object.__setattr__(self, "_comm", {})
        # replace() makes a new spec and with it an empty cache: prices never outlive what they assumed
        object.__setattr__(self, "_priced", {})


def planner_spec(
    cost: TableCostModel,
    config: DynPluginConfig,
    *,
    dp: int,
    zero_stage: int = 0,
    tp: int = 1,
    hidden_size: int | None = None,
    seed: int = 0,
    state_bytes: float | None = None,
) -> PlannerSpec:
    """Build the spec from the plugin config: stages, per-stage activation budget after model
    states (ZeRO stage and dp), the link between stages, allowed layouts and recompute modes.
    Padded micro-batches are priced and shaped at ``microbatching.pad_multiple``, the width the
    collate pads to.

    ``state_bytes``: a sharding plan's model states per rank (``ShardPlan.state_bytes``) in place
    of ZeRO's, on one pipeline stage; activations then get ``sharding.memory_budget_mb`` (else the
    device's memory) minus them, the budget the plan was searched for. Sharded modules gather in
    step on every rank, so the plan then has ZeRO-3's rules whatever ``zero_stage`` says: equal
    micro-batch counts and the same recompute per micro-batch index."""
    check_count("dp", dp, high=MAX_RANKS)
    check_count("tp", tp, high=MAX_RANKS)
    pipe, cluster, mb = config.pipeline, config.cluster, config.microbatching
    cost = cost.with_pad_multiple(mb.pad_multiple)
    if pipe.layers_per_stage:
        if sum(pipe.layers_per_stage) != cost.num_layers:
            raise ValueError(
                f"pipeline.layers_per_stage sums to {sum(pipe.layers_per_stage)}, the model has {cost.num_layers} layers"
            )
        stages = tuple(StageSpec(n, i == 0, i == pipe.stages - 1) for i, n in enumerate(pipe.layers_per_stage))
    else:
        stages = balanced_split(cost, pipe.stages, tp=tp)
    shared = step_fields(cost, config, stages, zero_stage=zero_stage, dp=dp, tp=tp, seed=seed, state_bytes=state_bytes)
    hidden = hidden_size or cost.hidden_size
    if not hidden:
        raise ValueError("the planner needs the model's hidden size (cost_model.model.hidden_size)")
    # Only what the cost model can price: a profile may measure fewer modes than exist.
    layouts = tuple(
        l
        for l in (LAYOUTS if mb.layout == "auto" else (mb.layout,))
        if any((l, r, tp) in cost.tables for r in RECOMPUTES)
    )
    recomputes = tuple(
        r
        for r in (RECOMPUTES if mb.recompute == "auto" else (mb.recompute,))
        if all((l, r, tp) in cost.tables for l in layouts)
    )
    if not layouts or not recomputes:
        have = ", ".join(f"{l}/{r}/tp{t}" for l, r, t in sorted(cost.tables))
        raise ValueError(
            f"cost model {cost.name!r} cannot price microbatching.layout={mb.layout!r}, "
            f"recompute={mb.recompute!r} at tp={tp} (it has {have}); profile those or change the config"
        )
    sp = config.sequence_parallel
    sizes = group_sizes(dp, sp.sizes) if sp.enabled else (1,)
    for k in sizes:
        attention_kind(k, sp.attention, cost.num_heads, cost.num_kv_heads)  # a size Ulysses cannot split: say so now
    equal = zero_stage >= 2 or shared["same_recompute"] or (sp.enabled and sp.balance == "intra")
    sp_link = (
        LinkSpec(cluster.intra_node_gb_per_s, cluster.latency_us),
        LinkSpec(cluster.inter_node_gb_per_s, cluster.latency_us),
    )
    return PlannerSpec(
        **shared,
        hidden_size=hidden,
        layouts=layouts,
        recomputes=recomputes,
        row_len=mb.max_seq_len,
        sp_sizes=sizes,
        sp_attention=sp.attention,
        pyramid=sp.pyramid and "none" in recomputes,
        equal_counts=equal,
        sp_link=sp_link,
        devices_per_node=cluster.devices_per_node,
    )


def step_fields(
    cost: Any,
    config: DynPluginConfig,
    stages: tuple,
    *,
    zero_stage: int,
    dp: int,
    tp: int,
    seed: int,
    state_bytes: float | None,
) -> dict[str, Any]:
    """The ``StepSpec`` fields every spec sets the same way, sequences or pairs (``cost``: a
    ``TableCostModel`` or an ``EncoderDecoderCostModel``, both pricing a stage's model states and
    the update): each stage's memory (the activation budget its model states leave, 1F1B's
    in-flight count), the link between stages (a node's while the stages and their tensor-parallel
    ranks fit one), the update after the last micro-batch (the gradient all-reduce over the
    data-parallel ranks, and the optimizer step), the pipeline's schedule policy, and ZeRO-3's rule
    of the same recompute per micro-batch index. ``state_bytes``: a sharding plan's model states in
    place of ZeRO's (its modules, too, gather in step on every rank)."""
    cluster = config.cluster
    device_bytes = device_budget(config, len(stages), state_bytes)
    memory = []
    for i, s in enumerate(stages):
        held = None if state_bytes is not None else cost.model_state_bytes(stage=s, zero_stage=zero_stage, dp=dp, tp=tp)
        states = state_bytes if held is None else held.total
        if states >= device_bytes:
            raise ValueError(
                f"pipeline stage {i} ({s.held}) needs {states / MB:.0f} MB for model states (ZeRO-{zero_stage}, dp={dp}) but "
                f"plans may use {device_bytes / MB:.0f} MB of a device (memory_mb x memory_fraction, less the "
                f"allocator's margin); add pipeline stages, raise the ZeRO stage or the memory"
            )
        if held is not None and held.update_peak > device_bytes:
            raise ValueError(
                f"pipeline stage {i} ({s.held}) needs {held.update_peak / MB:.0f} MB for model states and "
                f"the optimizer step's fp32 gradients (ZeRO-{zero_stage}, dp={dp}, tp={tp}) but plans may use "
                f"{device_bytes / MB:.0f} MB of a device; add pipeline stages, raise tp, the ZeRO stage or the memory"
            )
        memory.append(StageMemory(budget=device_bytes - states, in_flight=len(stages) - i, states=states))
    same_node = len(stages) * tp <= cluster.devices_per_node
    link = LinkSpec(cluster.intra_node_gb_per_s if same_node else cluster.inter_node_gb_per_s, cluster.latency_us)
    dp_same_node = dp * len(stages) * tp <= cluster.devices_per_node
    update = cost.update_ms(
        stages,
        zero_stage=zero_stage,
        dp=dp,
        tp=tp,
        link_gb_per_s=cluster.intra_node_gb_per_s if dp_same_node else cluster.inter_node_gb_per_s,
    )
    return {
        "cost": cost,
        "stages": stages,
        "memory": tuple(memory),
        "dp": dp,
        "link": link,
        "tp": tp,
        "seed": seed,
        "schedule": config.pipeline.schedule,
        "cap_in_flight": config.pipeline.cap_in_flight,
        "update_ms": update,
        "same_recompute": zero_stage >= 3 or state_bytes is not None,
    }


def device_budget(config: DynPluginConfig, stages: int, state_bytes: float | None) -> float:
    """Bytes a rank's plans may fill: the device's plannable memory, or under a sharding plan (its
    model states ``state_bytes``, one pipeline stage) the sharding budget, which must leave room
    for activations."""
    device_bytes = config.cluster.device.plannable_mb * MB
    if state_bytes is None:
        return device_bytes
    if stages > 1:
        raise ValueError(
            f"a sharding plan's model states (state_bytes) are those of the whole model: they need "
            f"pipeline.stages = 1, not {stages}"
        )
    budget = config.sharding.memory_budget_mb
    device_bytes = budget * MB if budget else device_bytes
    if state_bytes >= device_bytes:
        raise ValueError(
            f"the sharding plan's model states take {state_bytes / MB:.0f} MB of the "
            f"{device_bytes / MB:.0f} MB per rank (sharding.memory_budget_mb, else the device's "
            "memory): none is left for activations; search the plan for this budget"
        )
    return device_bytes


def balanced_split(cost: TableCostModel, num_stages: int, *, tokens: int = 4096, tp: int = 1) -> tuple[StageSpec, ...]:
    """Layers per stage so that stage times are as even as they can be: the first stage also
    runs the embedding and the last the head, so an even split leaves the last stage slowest
    and every other stage waiting on it. Priced on a ``tokens``-token packed micro-batch."""
    stages = list(split_layers(cost.num_layers, num_stages))
    if num_stages == 1:
        return tuple(stages)
    table = cost.table("packed", "none", tp)
    f = features([tokens], "packed", cost.pad_multiple)

    def t(s: StageSpec) -> float:
        c = evaluate_stage(table, f, s)
        return c.forward_ms + c.backward_ms

    while True:
        times = [t(s) for s in stages]
        hi, lo = int(np.argmax(times)), int(np.argmin(times))
        if stages[hi].num_layers <= 1:
            break
        moved = list(stages)
        moved[hi] = StageSpec(stages[hi].num_layers - 1, stages[hi].first, stages[hi].last)
        moved[lo] = StageSpec(stages[lo].num_layers + 1, stages[lo].first, stages[lo].last)
        if max(t(s) for s in moved) >= max(times) - 1e-9:
            break
        stages = moved
    return tuple(stages)
