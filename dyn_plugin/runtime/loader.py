"""DynLoader: a drop-in for a torch DataLoader that yields one planned optimizer step at a time.

    loader = DynLoader(dataset, lengths=lengths, config=cfg, cost_model=cm,
                       layout=RankLayout(world=n * k, stages=k), stage=s, column=c, seed=1234)
    for step in loader:
        step.micro_batches   # this rank's micro-batches, in execution order (dicts of tensors)
        step.plan            # this rank's execution plan
        step.scored_tokens   # scored tokens of the whole global batch: divide summed losses by it

Samples are token sequences (``lengths``: one count each) or, for an encoder-decoder, (input,
target) pairs (``lengths`` of shape [N, 2], planned by the encoder-decoder planner with its cost
model, each micro-batch padded or packed per side, ``collate_pairs``).

Exactly once: an epoch's global batches partition the samples and every sample of a global
batch goes to exactly one replica's micro-batches (pipeline stages of one replica share them).
A replica may be a sequence-parallel group of several data-parallel ranks: each of them lists
the group's samples and holds its shard of every row (``Step.shards``).
``state_dict()`` after any step and ``load_state_dict()`` on a fresh loader resume at the next
global batch, with the same plans.

This module iterates and builds the steps; the loader owns the other two concerns:
plan_source.py says where each plan comes from (planned here, or read from the store the
background planner processes fill, with its fault handling), and plan_agreement.py checks
that every rank holds the same plan for each step (``PlanMismatch`` where they do not) and makes
them stop together.
"""

from __future__ import annotations

import hashlib
import logging
import numbers
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from ..checks import MAX_SEED, check_count, check_number
from ..config import DynPluginConfig, LoadedConfig, load_config
from ..cost.encoder_decoder import EncoderDecoderCostModel
from ..cost.table import TableCostModel
from ..device import collective_device
from ..layout import RankLayout
from ..lengths.io import cap_lengths, validate_lengths
from ..lengths.pairs import validate_pairs
from ..plan.steps.instructions import ExecutionPlan, PlannedMicroBatch
from .calibration import RunCalibration
from .collate import collate, shard
from .collate_pairs import collate_pairs
from .plan_agreement import GIVE_UP_LAG, PlanAgreement
from .plan_source import PlanSource
from .planning import PlanningContext, RankPlan
from .sampler import epoch_batches

logger = logging.getLogger(__name__)

STATE_VERSION = 2


@dataclass
class Step:
    epoch: int
    index: int  # global batch index within the epoch
    plan: ExecutionPlan
    micro_batches: list[dict[str, torch.Tensor]]  # empty on stages that load nothing (middle stages)
    sample_ids: list[list[int]]  # dataset indices of each micro-batch in micro_batches
    scored_tokens: int  # tokens the loss scores, over the whole global batch
    digest: str  # fingerprint of the whole step's plan, equal on every rank
    predicted_ms: float  # the cost model's simulated time of the whole step
    predicted_peak_mb: float | None = None  # this rank's peak device memory by the plan (None: a hand-made step)
    # with online calibration: the host hands it each micro-batch's measured (forward ms, backward
    # ms) and the step's peak device bytes (None where not measured) after the step, every rank, as
    # it gathers them: the micro-batches it loaded in load order (the token-mean step), or on a
    # pipeline stage every micro-batch of its plan in plan order (PlanPipelineEngine)
    observe: Callable[[list, float | None], None] | None = None

    @property
    def loaded(self) -> list[PlannedMicroBatch]:
        """The plan's description of each entry of ``micro_batches``, in the same order."""
        return [self.plan.micro_batches[m] for m in self.plan.loads]

    @property
    def shards(self) -> list[tuple[int, int, int]]:
        """(group size, group's first column, this rank's shard index) of each entry of
        ``micro_batches``: an entry with group size > 1 holds shard ``index`` of every row."""
        return [(d.sp, d.group, self.plan.column - d.group) for d in self.loaded]


class DynLoader:
    def __init__(
        self,
        dataset: Sequence[Any],
        *,
        lengths: Sequence[int],
        config: DynPluginConfig | LoadedConfig | str | os.PathLike | Mapping,
        cost_model: TableCostModel | EncoderDecoderCostModel,
        layout: RankLayout | None = None,
        stage: int = 0,
        column: int = 0,
        seed: int = 0,
        zero_stage: int | None = None,
        replica: int = 0,
        pad_id: int = 0,
        device: torch.device | str | None = None,
        state_bytes: float | None = None,
    ) -> None:
        """``layout``: the run's stages x data-parallel columns x tensor-parallel ranks (default: one
        column of ``pipeline.stages`` stages); ``stage``, ``column`` and ``replica`` (its
        tensor-parallel rank): this rank's place in it; the ``layout.tp`` ranks of a cell share its plan. ``device``:
        where the loader's collectives run (run-id broadcast, plan check); by default where the
        default process group's backend takes tensors (``dyn_plugin.device.collective_device``). ``state_bytes``: a sharding
        plan's model states per rank (``ShardPlan.planning_state_bytes``), planned with in place of
        ZeRO's (with ``zero_stage=3``: equal micro-batch counts, the same recompute per micro-batch
        index)."""
        if not isinstance(config, (DynPluginConfig, LoadedConfig)):
            config = load_config(config)
        if isinstance(config, LoadedConfig):
            zero_stage = config.zero_stage if zero_stage is None else zero_stage
            config = config.plugin
        self.config = config
        layout = layout or RankLayout.of(1, config.pipeline.stages)
        if layout.stages != config.pipeline.stages:
            raise ValueError(
                f"the layout has {layout.stages} stages but dyn_plugin.pipeline.stages = "
                f"{config.pipeline.stages}; they must match"
            )
        layout.rank_of(stage, column, replica)  # refuses a place outside the layout
        self.replica = replica
        check_count("seed", seed, low=0, high=MAX_SEED)
        if state_bytes is not None:
            check_number("state_bytes", state_bytes, low=-1e-9)  # 0 is a plan keeping nothing; below is not
        self.dataset = dataset
        self.layout, self.stage, self.column = layout, stage, column
        self.seed, self.pad_id = seed, pad_id
        self.lengths = self._checked_lengths(lengths)
        self.context = PlanningContext(
            config,
            cost_model,
            self.lengths,
            layout.columns,
            layout.stages,
            zero_stage or 0,
            layout.tp,
            seed,
            state_bytes,
        )
        self.epoch, self.step = 0, 0
        self.plan_wait_s: list[float] = []  # per step, how long this rank waited for its plan
        # hashed once (8 MB at 1M samples), for the resume check and the plan check alike
        lengths_hash = hashlib.sha256(self.lengths.tobytes())
        self._state_fingerprint = self._fingerprint(lengths_hash.copy())
        self.device = torch.device(device) if device is not None else collective_device()
        sizes = (seed, layout.columns, layout.stages, zero_stage or 0, layout.tp, state_bytes)
        self._agreement = PlanAgreement(lengths_hash.digest(), cost_model, config, sizes, self.device)
        self._source = PlanSource(
            config,
            self.context,
            layout,
            stage=stage,
            column=column,
            replica=replica,
            device=self.device,
            data_fingerprint=self._state_fingerprint,
        )
        self.calibration = self._calibration()

    def _calibration(self) -> RunCalibration | None:
        """The online calibration (``calibration.enabled``) where the cost model has fits to refit (a
        profile's tables, or an encoder-decoder's pair tables) and plans can be made again alike on
        every rank."""
        st = self.config.strategy
        if (
            not self.config.calibration.enabled
            or not isinstance(self.context.cost, (TableCostModel, EncoderDecoderCostModel))
            # a solve under a wall-clock limit cannot be made again alike on every rank, which a
            # plan priced with an older version needs (plan_source)
            or (st.enabled and st.ilp_time_budget_ms is not None)
        ):
            return None
        # weakly: a step kept by the host holds the calibration, and must not keep the planners alive
        source = weakref.ref(self._source)
        lag = self.config.loader.prefetch if self._source.store is not None else 0

        def store() -> Any:
            held = source()
            return held.store if held is not None else None

        return RunCalibration(self.context, self.config.calibration, lag=lag, store=store, host=self._source.is_host)

    @property
    def is_host(self) -> bool:
        """The rank that hosts the embedded store and the planner processes."""
        return self._source.is_host

    # the store and the planner pool, for tests and hosts that reach in (None until opened, started)
    @property
    def _store(self):
        return self._source.store

    @property
    def _pool(self):
        return self._source.pool

    def _checked_lengths(self, lengths: Sequence[int] | Sequence[Sequence[int]]) -> np.ndarray:
        """One length per sample, or [N, 2] (input, target) pairs, each side capped as lengths are."""
        pairs = np.ndim(lengths) == 2
        arr = validate_pairs(lengths) if pairs else validate_lengths(lengths)
        if len(arr) != len(self.dataset):
            raise ValueError(
                f"lengths has {len(arr)} entries but the dataset has {len(self.dataset)} samples; "
                f"give one {'(input, target) pair' if pairs else 'length (token count)'} per sample"
            )
        mb = self.config.microbatching
        if pairs:
            return np.stack([cap_lengths(arr[:, side], mb.max_seq_len, mb.truncate) for side in (0, 1)], axis=1)
        return cap_lengths(arr, mb.max_seq_len, mb.truncate)

    def __len__(self) -> int:
        """Global batches left in the current epoch."""
        return len(self.context.batches(self.epoch)) - self.step

    def __iter__(self) -> Iterator[Step]:
        """The rest of the current epoch; the next iteration starts the next epoch."""
        epoch, agreement, source = self.epoch, self._agreement, self._source
        while self.epoch == epoch and self.step < len(self.context.batches(epoch)):
            agreement.check_plans(block=False, settle=self.step - GIVE_UP_LAG)
            agreement.raise_if_given_up(self.step - GIVE_UP_LAG, source.store)
            rank_plan = self._plan(epoch, self.step)
            agreement.check_plans(block=False)
            agreement.start_check(rank_plan, gave_up=source.health.gave_up, rejected=source.health.rejected)
            agreement.check_first()
            # Counted as consumed once handed out: state_dict() taken after training on this step
            # resumes at the next one.
            self.step += 1
            yield self._build(rank_plan)
        agreement.check_plans(block=True)
        agreement.raise_if_given_up(None, source.store)
        if self.epoch == epoch:
            self.epoch, self.step = epoch + 1, 0

    def _plan(self, epoch: int, step: int) -> RankPlan:
        t0 = time.perf_counter()
        rp = self._source.plan(epoch, step)
        self.plan_wait_s.append(time.perf_counter() - t0)
        return rp

    def _observer(self, rp: RankPlan) -> Callable[[list, float | None], None] | None:
        """What the host calls with the step's measured micro-batches: the online calibration's."""
        if self.calibration is None:
            return None
        calibration, position = self.calibration, self.context.position(rp.epoch, rp.step)
        plan = rp.plan
        # what the host times: without a pipeline the micro-batches it loaded, in that order; a
        # pipeline stage runs every micro-batch of its plan, timed in plan order
        ran = list(plan.micro_batches) if plan.num_stages > 1 else [plan.micro_batches[m] for m in plan.loads]
        # the calibration, not the loader: a step the host keeps must not keep the loader (and its planners)
        return lambda timings, peak_bytes=None: calibration.observe(
            position, plan.stage, ran, timings, peak_bytes, rp.predicted_peak_mb
        )

    def _build(self, rp: RankPlan) -> Step:
        tensors, ids = [], []
        for m in rp.plan.loads:
            desc = rp.plan.micro_batches[m]
            batch = load_micro_batch(desc, self.dataset.__getitem__, column=rp.plan.column, pad_id=self.pad_id)
            if self.device.type == "cuda":  # page-locked: the hosts' copies to the GPU run asynchronously
                batch = {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in batch.items()}
            tensors.append(batch)
            ids.append(list(desc.sample_ids))
        return Step(
            rp.epoch,
            rp.step,
            rp.plan,
            tensors,
            ids,
            rp.scored_tokens,
            rp.digest,
            rp.predicted_ms,
            rp.predicted_peak_mb,
            self._observer(rp),
        )

    def state_dict(self) -> dict:
        """The position (epoch, step) and what it means: the data's identity (lengths, seed, token
        budget) and the data-parallel columns that shaped the epoch's global batches."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "step": self.step,
            "seed": self.seed,
            "fingerprint": self._state_fingerprint,
            "columns": self.layout.columns,
            "calibration": self.calibration.state_dict() if self.calibration is not None else None,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from ``state``. The data must be the same (lengths, seed, token budget); the
        data-parallel size may differ where the interrupted epoch's order survives it: a global batch
        holds at least one sequence per column, so only batches that the minimum shaped can differ,
        and the resume is refused when one of those lies in the part of the epoch already trained."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"loader state version {state.get('version')!r}; this dyn-plugin reads {STATE_VERSION} "
                "(the checkpoint was written by another dyn-plugin version)"
            )
        if state["fingerprint"] != self._state_fingerprint:
            raise ValueError(
                "loader state was saved for different lengths, seed, token budget or lookahead; "
                "resume with the same dataset and dyn_plugin config"
            )
        epoch, step, columns = int(state["epoch"]), int(state["step"]), int(state["columns"])
        if columns != self.layout.columns and step > 0:
            mb = self.config.microbatching
            saved = epoch_batches(
                self.lengths,
                mb.global_tokens,
                seed=self.seed,
                epoch=epoch,
                min_sequences=columns,
                lookahead=mb.lookahead,
            )
            if saved[:step] != self.context.batches(epoch)[:step]:
                raise ValueError(
                    f"the checkpoint was saved on {columns} data-parallel columns, this run has "
                    f"{self.layout.columns}: epoch {epoch}'s first {step} global batches differ between the two, so "
                    f"the samples left would not be the ones the interrupted run had left; resume on {columns} "
                    "columns, or from a checkpoint taken at an epoch's end"
                )
            logger.info(
                "resuming on %d data-parallel columns (saved on %d): epoch %d keeps its order",
                self.layout.columns,
                columns,
                epoch,
            )
        self.epoch, self.step = epoch, step
        if self.calibration is not None and state.get("calibration"):
            self.calibration.load_state_dict(state["calibration"])

    @property
    def position(self) -> int:
        """Global batches handed out since the run began (over every epoch): orders checkpoints."""
        return self.context.position(self.epoch, self.step)

    def _fingerprint(self, h: "hashlib._Hash") -> str:
        """``h``: the lengths' sha256, extended here; computed once (state_dict() runs at every checkpoint).
        The layout is not in it: ``load_state_dict`` judges a change of data-parallel size itself."""
        mb = self.config.microbatching
        # the lookahead shapes the epoch's batches too (0, the earlier rule, kept out: its checkpoints still resume)
        h.update(repr((self.seed, mb.global_tokens) + ((mb.lookahead,) if mb.lookahead else ())).encode())
        return h.hexdigest()[:16]

    def close(self) -> None:
        """Stop whatever the loader started (planner processes, a store it hosts)."""
        self._source.close()


def load_micro_batch(
    desc: PlannedMicroBatch, fetch: Callable[[int], Any], *, column: int, pad_id: int = 0
) -> dict[str, Any]:
    """The tensors of one planned micro-batch on the rank at data-parallel ``column``; ``fetch(i)``
    returns dataset item i. A plan of (input, target) pairs (``seq_lens`` of pairs) is padded per
    side or packed per side (``collate_pairs``); sequences are built in
    the plan's layout and, under sequence parallelism, cut to this rank's shard."""
    if desc.seq_lens and not isinstance(desc.seq_lens[0], numbers.Integral):
        if desc.sp > 1:
            raise ValueError(
                f"a micro-batch of (input, target) pairs planned with sp {desc.sp}: pairs are built without sequence "
                "parallelism; plan them with sp 1"
            )
        return collate_pairs(desc.sample_ids, desc.seq_lens, desc.layout, desc.shape, fetch, pad_id=pad_id)
    batch = collate(desc.sample_ids, desc.seq_lens, desc.layout, desc.shape, fetch, pad_id=pad_id, sp=desc.sp)
    return shard(batch, desc.sp, column - desc.group) if desc.sp > 1 else batch
