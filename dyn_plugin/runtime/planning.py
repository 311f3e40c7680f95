"""From a global batch to what one rank runs: the bridge between planners and the loader.

Everything a planner process needs travels as JSON (``PlanningContext.to_json``): the plugin
config, the cost model's coefficients, the lengths, the strategy proposal. Every rank, or every
planner process, derives the same plan for the same (epoch, step), so nothing but the result
crosses a store.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, replace

import numpy as np

from ..config import ConfigError, DynPluginConfig, with_password
from ..cost.encoder_decoder import EncoderDecoderCostModel
from ..cost.online import Calibration
from ..cost.table import TableCostModel
from ..plan.assignment.two_stage import Stage2Options
from ..plan.methods.pair_baselines import PAIR_BASELINES
from ..plan.methods.planner import execution_plans
from ..plan.methods.registry import plan_method
from ..plan.steps.instructions import ExecutionPlan, check_plans, plan_from_json, plan_to_json
from ..plan.steps.pair_planner import plan_pairs
from ..plan.steps.pair_spec import PairSpec, pair_planner_spec
from ..plan.steps.pricing import checkpointed_layers
from ..plan.steps.spec import MB, PlannerSpec, planner_spec
from ..plan.steps.types import StepPlan
from ..plan.strategies.strategy import Proposal, Strategy, plan_strategy_step, runnable_proposal
from .collate import scored_tokens
from .sampler import epoch_batches

RANK_PLAN_SCHEMA = "dyn_plugin.rank_plan"
# microbatching.method -> the pair baseline that batches (input, target) pairs as it batches sequences.
# packing_full (rows of the maximum length, attention over the whole row) is T5's packing per side: rows
# of max_seq_len a side, run exactly (each pair masked to itself: models.seq2seq); packing_varlen is not,
# as T5 has no per-document attention kernel to make rows cost their real tokens only
PAIR_METHODS = {"fixed_padding": "pair_padding", "token_budget": "pair_token_budget", "packing_full": "pair_packing"}

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankPlan:
    """One rank's share of one global batch."""

    epoch: int
    step: int
    plan: ExecutionPlan
    scored_tokens: int  # scored tokens of the whole global batch, every replica included
    digest: str  # of the whole step plan: every rank must hold the same one
    predicted_ms: float  # the simulated step time of the whole plan
    # this rank's predicted peak device memory: its stage's simulated activation peak and model states
    predicted_peak_mb: float | None = None
    calibration: int = 0  # the online calibration version it was priced with (0: the profile)

    def to_meta(self) -> dict:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "scored_tokens": self.scored_tokens,
            "digest": self.digest,
            "predicted_ms": self.predicted_ms,
            "predicted_peak_mb": self.predicted_peak_mb,
            "calibration": self.calibration,
            "plan": json.loads(plan_to_json(self.plan)),
        }

    @classmethod
    def from_meta(cls, meta: dict) -> "RankPlan":
        return cls(
            meta["epoch"],
            meta["step"],
            plan_from_json(json.dumps(meta["plan"])),
            int(meta["scored_tokens"]),
            meta["digest"],
            float(meta["predicted_ms"]),
            meta["predicted_peak_mb"],
            int(meta.get("calibration", 0)),
        )


def step_digest(plan: StepPlan) -> str:
    """A fingerprint of the whole plan (which samples, on which group of columns, in which order, how)."""
    h = hashlib.sha256()
    for r in plan.replicas:
        h.update(repr((r.first, r.size, r.schedule.order)).encode())
        for mb in r.micro_batches:
            h.update(repr((mb.sample_ids, mb.layout, mb.recompute, mb.shape, mb.sp, mb.checkpointed)).encode())
    return h.hexdigest()[:16]


@dataclass
class PlanningContext:
    """The inputs of every plan of a run; plans (epoch, step) for every rank."""

    config: DynPluginConfig
    cost: TableCostModel | EncoderDecoderCostModel
    lengths: np.ndarray  # [N], or [N, 2] (input, target) pairs
    dp: int
    pp: int
    zero_stage: int = 0
    tp: int = 1
    seed: int = 0
    state_bytes: float | None = None  # a sharding plan's model states per rank, in place of ZeRO's (planner_spec)
    proposal: Proposal | None = None  # with strategy.enabled: the strategies steps are planned under (else built)

    def __post_init__(self) -> None:
        if self.pairs:
            self._check_pairs()
        elif isinstance(self.cost, EncoderDecoderCostModel):
            raise ValueError(
                f"cost model {self.cost.name!r} prices an encoder-decoder, but the lengths are one token count per "
                "sample; give an encoder-decoder's lengths as [N, 2] (input, target) pairs"
            )
        self.spec: PlannerSpec | PairSpec = self._spec_of(self.cost)
        # the online calibrations (cost/online.py) steps are priced with, each from its from_step on;
        # version 0 is the profile as measured. Every rank and planner holds the same list.
        self.calibrations: list[Calibration] = [Calibration()]
        self._specs: dict[int, PlannerSpec | PairSpec] = {0: self.spec}
        if self.config.strategy.enabled:
            if self.proposal is None:
                self.proposal = self._build_proposal()
            check_runnable(
                self.proposal,
                columns=self.dp,
                tp=self.tp,
                pp=self.pp,
                sizes=self.config.sequence_parallel.sizes,
                source=self.config.strategy.proposal,
            )
        self._epochs: dict[int, list[list[int]]] = {}
        self._offsets: dict[int, int] = {0: 0}  # run-wide position of each epoch's first batch
        self._extrapolated = 0  # steps planned with costs beyond the measured range so far

    def _spec_of(self, cost: TableCostModel | EncoderDecoderCostModel) -> PlannerSpec | PairSpec:
        """The planner's spec of this run over ``cost`` (the profile's, or a calibrated one)."""
        return (pair_planner_spec if self.pairs else planner_spec)(
            cost,
            self.config,
            dp=self.dp,
            zero_stage=self.zero_stage,
            tp=self.tp,
            seed=self.seed,
            state_bytes=self.state_bytes,
        )

    def add_calibration(self, calibration: Calibration) -> None:
        """Price the steps from ``calibration.from_step`` on with it (a version already held is ignored:
        the host publishes the whole list, and a planner reads it again)."""
        if calibration.version <= self.calibrations[-1].version:
            return
        self.calibrations.append(calibration)
        spec = self._spec_of(calibration.apply(self.cost))
        # a stage that alone runs slower: its factor on the stage's priced times (the tables are shared)
        stage_time = tuple(calibration.stage_factor(i) for i in range(spec.pp)) if calibration.stages else ()
        self._specs[calibration.version] = replace(spec, stage_time=stage_time)

    def calibration_at(self, position: int) -> Calibration:
        """The calibration that prices the global batch at run-wide ``position``: the newest version
        pricing from it or before (a rise of the memory factor may price from an earlier step than
        the version before it, which it then replaces there: each version holds every factor)."""
        return next(c for c in reversed(self.calibrations) if c.from_step <= position)

    @property
    def pairs(self) -> bool:
        """Whether the samples are (input, target) pairs (lengths [N, 2]) for an encoder-decoder."""
        return self.lengths.ndim == 2

    def _check_pairs(self) -> None:
        """Pairs are planned by the encoder-decoder planner (plan_pairs) or a padded pair baseline, and
        nothing else yet."""
        cfg = self.config
        if not isinstance(self.cost, EncoderDecoderCostModel):
            raise ValueError(
                "the lengths are (input, target) pairs but the cost model prices a decoder-only model; plan pairs "
                "with an encoder-decoder cost model (dyn_plugin.cost.encoder_decoder)"
            )
        refused = [
            (
                cfg.microbatching.method not in ("dynapipe", *PAIR_METHODS),
                f"microbatching.method {cfg.microbatching.method!r}",
                f"'dynapipe' or the baselines {', '.join(map(repr, PAIR_METHODS))} (pairs packed per side run "
                "attention over the whole row: 'packing_full')",
            ),
            (cfg.strategy.enabled, "strategy.enabled", "false"),
            (cfg.sequence_parallel.enabled, "sequence_parallel.enabled", "false"),
        ]
        for on, what, fix in refused:
            if on:
                raise ValueError(f"{what} with (input, target) pairs: not built for encoder-decoder plans; use {fix}")

    def batches(self, epoch: int) -> list[list[int]]:
        """The epoch's global batches (sample indices), cached: every step of it needs them."""
        if epoch not in self._epochs:
            self._epochs = {
                epoch: epoch_batches(
                    self.lengths,
                    self.config.microbatching.global_tokens,
                    seed=self.seed,
                    epoch=epoch,
                    min_sequences=self.dp,
                    lookahead=self.config.microbatching.lookahead,
                )
            }
        return self._epochs[epoch]

    def position(self, epoch: int, step: int) -> int:
        """Run-wide index of a global batch: epochs differ in batch count, so offsets accumulate."""
        while epoch not in self._offsets:
            last = max(self._offsets)
            self._offsets[last + 1] = self._offsets[last] + len(self.batches(last))
        return self._offsets[epoch] + step

    def locate(self, position: int) -> tuple[int, int]:
        """(epoch, step) of a run-wide position; the inverse of ``position``."""
        epoch = max(e for e, off in self._offsets.items() if off <= position)
        while position - self._offsets[epoch] >= len(self.batches(epoch)):
            self.position(epoch + 1, 0)
            epoch += 1
        return epoch, position - self._offsets[epoch]

    def _build_proposal(self) -> Proposal:
        """The proposal ``strategy.proposal`` names, or one proposed from the run's lengths."""
        st = self.config.strategy
        if st.proposal is not None:
            try:
                return Proposal.load(st.proposal)
            except FileNotFoundError:
                raise ConfigError(
                    f"strategy.proposal = {st.proposal!r} does not exist; write one with `dynplugin "
                    "strategy`, or unset it to propose at start-up"
                ) from None
        proposal = runnable_proposal(
            self.lengths, self.spec, tokens=self.config.microbatching.global_tokens, max_strategies=st.max_strategies
        )
        logger.info(
            "strategy proposal %s from the run's %d lengths: %s",
            proposal.key,
            len(self.lengths),
            "; ".join(_describe(s) for s in proposal.strategies),
        )
        return proposal

    def plan_batch(
        self, lens: list[int] | list[tuple[int, int]], spec: PlannerSpec | PairSpec | None = None
    ) -> StepPlan:
        """The step plan of one global batch's lengths (or pairs), as the config says to plan it
        (``spec``: priced under a calibration; the profile's by default)."""
        method = self.config.microbatching.method
        st = self.config.strategy
        spec = spec or self.spec
        if self.pairs:
            inputs, targets = (list(side) for side in zip(*lens))
            if method == "dynapipe":
                return plan_pairs(inputs, targets, spec)
            longest = self.config.microbatching.max_seq_len  # a side's, as fixed padding pads sequences to it
            return PAIR_BASELINES[PAIR_METHODS[method]](inputs, targets, spec, longest, longest)
        if st.enabled:
            budget = st.ilp_time_budget_ms
            stage2 = Stage2Options(st.stage2, st.ilp_node_limit, budget / 1000 if budget is not None else None)
            return plan_strategy_step(lens, spec, self.proposal, stage2=stage2)
        return plan_method(method, lens, spec=spec, max_len=self.config.microbatching.max_seq_len)

    def _batch(self, epoch: int, step: int) -> tuple[list[int], list]:
        """Global batch ``step`` of ``epoch``: its samples' dataset indices and their lengths (or pairs)."""
        ids = self.batches(epoch)[step]
        return ids, [tuple(int(x) for x in self.lengths[i]) if self.pairs else int(self.lengths[i]) for i in ids]

    def step_plan(self, epoch: int, step: int) -> StepPlan:
        """The step plan of global batch ``step`` of ``epoch`` (its micro-batches' sample ids index
        the global batch), priced with the calibration that prices it: what ``plan`` cuts into the
        ranks' plans, and what a trace of the executed step is set beside."""
        lens = self._batch(epoch, step)[1]
        return self.plan_batch(lens, self._specs[self.calibration_at(self.position(epoch, step)).version])

    def plan(self, epoch: int, step: int) -> dict[tuple[int, int], RankPlan]:
        """(dp_rank, pp_rank) -> that rank's plan, for global batch ``step`` of ``epoch``."""
        ids, lens = self._batch(epoch, step)
        method = self.config.microbatching.method
        version = self.calibration_at(self.position(epoch, step)).version
        plan = self.step_plan(epoch, step)
        counts = [len(r.micro_batches) for r in plan.replicas]
        # a sharding plan's modules gather in step on every rank, as ZeRO-3's do
        sharded = self.state_bytes is not None
        who = "a sharding plan" if sharded else f"ZeRO-{self.zero_stage}"
        if (self.zero_stage >= 2 or sharded) and len(set(counts)) > 1:
            raise ValueError(
                f"global batch {step} of epoch {epoch}: microbatching.method {method!r} gave the replicas "
                f"{counts} micro-batches, but {who} needs the same number on every "
                "data-parallel rank; use method 'dynapipe' (it plans equal counts) or ZeRO stage 0 or 1"
            )
        modes = [
            tuple((r.micro_batches[i].recompute, self._checkpointed(r.micro_batches[i])) for i in r.schedule.order)
            for r in plan.replicas
        ]  # in the order each replica runs them
        if (self.zero_stage == 3 or sharded) and len(set(modes)) > 1:
            # the planner makes them alike (pricing.same_recompute); a baseline or a hand-made plan may
            # not, and ranks that recompute differently desynchronise ZeRO-3's gathers (a hang under NCCL)
            raise ValueError(
                f"global batch {step} of epoch {epoch}: the replicas recompute differently at the same "
                f"micro-batch ({[[m for m, _ in r] for r in modes]}), but {who} needs the same "
                "recompute at each micro-batch index on every rank; set microbatching.recompute to one "
                "mode or use ZeRO stage 0-2"
            )
        if plan.extrapolated:
            # allowed by cost_model.allow_extrapolation, never silent: the first time, then every 100th step
            if self._extrapolated % 100 == 0:
                logger.warning(
                    "global batch %d of epoch %d: %d micro-batch(es) priced beyond what cost model %r "
                    "measured (longest sequence %d); profile longer sequences for exact prices "
                    "(%d step(s) so far)",
                    step,
                    epoch,
                    plan.extrapolated,
                    self.cost.name,
                    max(lens),
                    self._extrapolated + 1,
                )
            self._extrapolated += 1
        digest = step_digest(plan)
        tokens = scored_tokens(lens)
        # Plans index the global batch; the loader needs dataset indices.
        plan = replace(
            plan,
            replicas=tuple(
                replace(
                    rep,
                    micro_batches=tuple(
                        replace(mb, sample_ids=tuple(int(ids[i]) for i in mb.sample_ids)) for mb in rep.micro_batches
                    ),
                )
                for rep in plan.replicas
            ),
        )
        if self.pairs:  # links carry both sides past the split (instructions.link_shapes)
            plans = _described_pairs(
                execution_plans(plan, self.cost.hidden_size, split_rank=self.spec.split_rank), plan
            )
        else:
            plans = execution_plans(plan, self.spec.hidden_size)
        # every plan a rank runs has been replayed as NCCL runs it: a hang becomes an error here
        check_plans(list(plans.values()), rendezvous=True)
        return {
            key: RankPlan(epoch, step, ep, tokens, digest, plan.iteration_ms, self._peak_mb(plan, ep), version)
            for key, ep in plans.items()
        }

    def _peak_mb(self, plan: StepPlan, ep: ExecutionPlan) -> float:
        """The peak device memory the plan predicts for the rank running ``ep``: its replica's simulated
        activation peak at its stage plus the model states the stage holds (what the planner kept
        within the device's memory)."""
        rep = next(r for r in plan.replicas if r.first <= ep.column < r.first + r.size)
        return (rep.sim.peak_bytes[ep.stage] + self.spec.memory[ep.stage].states) / MB

    def _checkpointed(self, mb) -> tuple[int, ...]:
        """A micro-batch's checkpointed layers per stage; pairs are planned in whole-stage modes only."""
        return tuple(mb.checkpointed) if self.pairs else checkpointed_layers(mb, self.spec)

    def to_json(self) -> str:
        config = self.config.model_dump(mode="json", exclude_unset=True)
        if "url" in config.get("store", {}):  # its password stays out: planners connect with the store's config
            config["store"]["url"] = with_password(config["store"]["url"], None)
        return json.dumps(
            {
                "config": config,
                "cost": self.cost.to_dict(),
                "lengths": self.lengths.tolist(),
                "dp": self.dp,
                "pp": self.pp,
                "zero_stage": self.zero_stage,
                "tp": self.tp,
                "seed": self.seed,
                "state_bytes": self.state_bytes,
                # planner processes plan under the very proposal the ranks hold (one proposed at start-up included)
                "proposal": self.proposal.to_json() if self.proposal is not None else None,
                "calibrations": [c.to_dict() for c in self.calibrations[1:]],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> "PlanningContext":
        d = json.loads(text)
        config = DynPluginConfig.model_validate(d["config"])
        cost = EncoderDecoderCostModel if d["cost"].get("kind") == "encoder_decoder" else TableCostModel
        context = cls(
            config,
            cost.from_dict(d["cost"]),
            np.asarray(d["lengths"], dtype=np.int64),
            d["dp"],
            d["pp"],
            d["zero_stage"],
            d["tp"],
            d["seed"],
            d.get("state_bytes"),
            Proposal.from_json(d["proposal"]) if d.get("proposal") else None,
        )
        for calibration in d.get("calibrations", []):
            context.add_calibration(Calibration.from_dict(calibration))
        return context


def _described_pairs(
    plans: dict[tuple[int, int], ExecutionPlan], plan: StepPlan
) -> dict[tuple[int, int], ExecutionPlan]:
    """Execution plans whose micro-batches describe (input, target) pairs as the runtime builds them:
    ``seq_lens`` of pairs and the shape (rows, input width, target width) of
    ``cost.encoder_decoder.pair_shape`` or, packed, ``packed_pair_shape`` (the planner's
    PairMicroBatch keeps each side apart)."""
    replica = {c: rep for rep in plan.replicas for c in rep.columns}
    out = {}
    for (column, stage), ep in plans.items():
        planned = replica[column].micro_batches  # described in this order (build_execution_plans)
        described = tuple(
            replace(
                d,
                seq_lens=tuple(zip(mb.seq_lens, mb.target_lens)),
                shape=(mb.shape[0], mb.shape[1], mb.target_shape[1]),
            )
            for d, mb in zip(ep.micro_batches, planned)
        )
        out[(column, stage)] = replace(ep, micro_batches=described)
    return out


def check_runnable(
    proposal: Proposal, *, columns: int, tp: int, pp: int, sizes: list[int], source: str | None = None
) -> None:
    """Refuse a proposal with a strategy this run cannot execute: DeepSpeed builds uniform replicas,
    so every pipeline must have the run's tensor and pipeline degrees; its pipelines must tile the
    run's data-parallel columns, in sequence-parallel groups of sizes the run builds. ``source``:
    the file it came from (None: proposed at start-up)."""
    origin = f"strategy.proposal {source!r}" if source else "the proposal made at start-up"
    for n, strategy in enumerate(proposal.strategies):
        where = f"{origin} (key {proposal.key}): strategy {n} ({_describe(strategy)})"
        if not strategy.runnable(tp, pp):
            degrees = sorted({(p.tp, p.pp) for p in strategy.pipelines})
            raise ConfigError(
                f"{where} has pipelines of (tp, pp) {degrees}, but this run's replicas all have tp={tp}, "
                f"pp={pp}: heterogeneous tensor/pipeline degrees are simulation-only (`dynplugin bench "
                "strategy`); propose with the run's tp and pp"
            )
        if strategy.gpus != columns * tp * pp:
            raise ConfigError(
                f"{where} uses {strategy.gpus} GPUs but the run has {columns} data-parallel columns x "
                f"tp {tp} x pp {pp} = {columns * tp * pp}; propose for this world size"
            )
        odd = sorted(set(strategy.grouping) - set(sizes))
        if odd:
            raise ConfigError(
                f"{where} has group size(s) {odd} outside sequence_parallel.sizes = {sizes}; add them "
                "to sizes or propose with these sizes"
            )


def _describe(strategy: Strategy) -> str:
    return f"{strategy.describe()}, longest sequence {strategy.longest}"
