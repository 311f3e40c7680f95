"""DynLoader: a drop-in for a torch DataLoader that yields one planned optimizer step at a time.

    loader = DynLoader(dataset, lengths=lengths, config=cfg, cost_model=cm,
                       layout=RankLayout(world=n * k, stages=k), stage=s, column=c, seed=1234)
    for step in loader:
        step.micro_batches   # this rank's micro-batches, in execution order (dicts of tensors)
        step.plan            # this rank's execution plan
        step.scored_tokens   # scored tokens of the whole global batch: divide summed losses by it

Without a store every rank plans each global batch itself; plans are deterministic, so ranks
agree without talking (DCP's way). With a store (``store`` section), background planner
processes plan ahead and each rank reads only its own plan (see planner_pool.py).

Samples are token sequences (``lengths``: one count each) or, for an encoder-decoder, (input,
target) pairs (``lengths`` of shape [N, 2], planned by the encoder-decoder planner with its cost
model, each micro-batch padded per side, ``collate_pairs``, or packed per side, ``collate_packed_pairs``).

Exactly once: an epoch's global batches partition the samples and every sample of a global
batch goes to exactly one replica's micro-batches (pipeline stages of one replica share them).
A replica may be a sequence-parallel group of several data-parallel ranks: each of them lists
the group's samples and holds its shard of every row (``Step.shards``).
``state_dict()`` after any step and ``load_state_dict()`` on a fresh loader resume at the next
global batch, with the same plans.

Agreement: when torch.distributed is initialized, every step's plan digest (with fingerprints
of the lengths, the cost model and the config) is all-gathered over the world, asynchronously
when the step is handed out, and checked when a later step is asked for (without waiting on the
device: a gather not finished yet is checked later) and, blocking, at the first step and at the
end of each epoch. Ranks that disagree raise :class:`PlanMismatch`, naming them and what differs.

Faults, with a store: a plan the planners cannot give is made on the waiting rank, and it is the
same plan (plans are deterministic in (epoch, step) and the planning context), so ranks need not
agree on who planned what: a planner that exited, one late by ``loader.local_plan_after_s`` (stopped,
frozen; the rank then stops waiting on it until it publishes again), a plan the store lost (expired,
a server restarted without its data) and a store that does not answer. A store down for
``loader.plan_timeout_s`` ends the run on every rank at the same step: the rank that gives up says
so in its next plan check, and every rank waits for the check ``GIVE_UP_LAG`` steps old before
each step, so all of them raise there, none is left inside a collective the others never enter.
Under ``strategy.ilp_time_budget_ms`` plans cannot be remade identically: ranks wait and fail instead.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import numbers
import os
import pickle
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from ..checks import MAX_SEED, check_count, check_number
from ..config import DynPluginConfig, LoadedConfig, load_config
from ..cost.encoder_decoder import EncoderDecoderCostModel
from ..cost.native import build
from ..cost.table import TableCostModel
from ..device import collective_device
from ..layout import RankLayout
from ..lengths.io import cap_lengths, validate_lengths
from ..lengths.pairs import validate_pairs
from ..plan.steps.instructions import ExecutionPlan, PlannedMicroBatch
from .collate import collate, shard
from .collate_pairs import collate_packed_pairs, collate_pairs
from .planning import PlanningContext, RankPlan
from .sampler import epoch_batches

logger = logging.getLogger(__name__)

STATE_VERSION = 2
# How often a rank waiting for its plan looks for a planner failure another process published.
FAILURE_POLL_S = 0.25
# While the store is down a rank plans each step itself and tries the store at most this often:
# a try can take store.timeout_s, which no step should pay every time.
OUTAGE_PROBE_S = 1.0
# What the ranks compare each step; the last three say why digests differ.
CHECKED = ("plan digest", "lengths", "cost model", "config", "dyn-plugin build")
# Each gathered row ends, after CHECKED, with this rank's reasons to stop every rank (bits):
GAVE_UP = 1  # it gave up on a store that stopped answering
REJECTED = 2  # a plan it read from the store failed its check (signature, size or schema)
ROW = len(CHECKED) + 1
# A rank's giving up is acted on this many steps later, when every rank waits for that step's check
# (two steps old: done long since, unless the host runs that far ahead of the device).
GIVE_UP_LAG = 2


class PlanMismatch(RuntimeError):
    """Ranks hold different plans for the same step."""


@dataclass
class _StoreHealth:
    """What a rank knows, between steps, of the store and the planners behind it."""

    down_since: float | None = None  # when this rank's first failed try of this outage began
    probed: float = 0.0  # when it last tried the store during the outage
    gave_up: bool = False  # down for plan_timeout_s: said in every later plan check
    rejected: bool = False  # a plan from the store failed its check here: said in every later plan check
    # (epoch, step, ranks, reason bit) of the first stop gathered: every rank raises at that step
    given_up: tuple[int, int, list[int], int] | None = None
    stalled: dict[int, bytes | None] = field(default_factory=dict)  # planner -> its progress when found late
    planners_failed: bool = False  # a planner exited: every step is planned here unless its plan is there
    served: bool = False  # a plan came from the store: the planners started, so a late plan is late
    warned_lost: bool = False  # plans the store lost are reported once per outage


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
        tp: int = 1,
        replica: int = 0,
        pad_id: int = 0,
        device: torch.device | str | None = None,
        state_bytes: float | None = None,
    ) -> None:
        """``layout``: the run's stages x data-parallel columns (default: one column of
        ``pipeline.stages`` stages); ``stage`` and ``column``: this rank's place in it. ``device``:
        where the loader's collectives run (run-id broadcast, plan check); by default where the
        default process group's backend takes tensors (``dyn_plugin.device.collective_device``). ``state_bytes``: a sharding
        plan's model states per rank (``ShardPlan.planning_state_bytes``), planned with in place of
        ZeRO's (with ``zero_stage=3``: equal micro-batch counts, the same recompute per micro-batch
        index). ``tp``: the ranks that share each cell's plan (tensor parallelism); ``replica``: this
        rank's index among them (its tensor-parallel rank)."""
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
        layout.rank_of(stage, column)  # refuses a place outside the layout
        if not 0 <= replica < tp:
            raise ValueError(f"replica {replica} is not in [0, tp={tp}): give this rank's tensor-parallel rank")
        self.tp, self.replica = tp, replica
        check_count("seed", seed, low=0, high=MAX_SEED)
        if state_bytes is not None:
            check_number("state_bytes", state_bytes, low=-1e-9)  # 0 is a plan keeping nothing; below is not
        self.dataset = dataset
        self.layout, self.stage, self.column = layout, stage, column
        self.seed, self.pad_id = seed, pad_id
        self.lengths = self._checked_lengths(lengths)
        self.context = PlanningContext(
            config, cost_model, self.lengths, layout.columns, layout.stages, zero_stage or 0, tp, seed, state_bytes
        )
        self.epoch, self.step = 0, 0
        self.plan_wait_s: list[float] = []  # per step, how long this rank waited for its plan
        # hashed once (8 MB at 1M samples), for the resume check and the plan check alike
        lengths_hash = hashlib.sha256(self.lengths.tobytes())
        self._state_fingerprint = self._fingerprint(lengths_hash.copy())
        self.device = torch.device(device) if device is not None else collective_device()
        self._checks: collections.deque = collections.deque()  # plan checks in flight, oldest first
        self._checked_first = False
        sizes = (seed, layout.columns, layout.stages, zero_stage or 0, tp, state_bytes)
        self._local_fingerprints = _fingerprints(lengths_hash.digest(), cost_model, config, sizes)
        self._store = self._pool = None
        self._health = _StoreHealth()
        st = config.strategy
        # a wall-clock limit makes a solve depend on the machine's load: another process may plan otherwise
        self._remakeable = not (st.enabled and st.ilp_time_budget_ms is not None)
        if config.store.backend != "none":
            self._open_store()

    @property
    def is_host(self) -> bool:
        """The rank that hosts the embedded store and the planner processes."""
        return self.column == 0 and self.stage == 0 and self.replica == 0

    def _open_store(self) -> None:
        from ..store import open_store

        cfg = self.config.store
        run = self._agree_run_id()
        if run is not None:
            # a fresh id per run under the configured (or a derived) prefix: nothing an earlier run
            # left in the store (plans, a stop key, a failure) is ever read by this one
            base = cfg.namespace or f"run-{self._state_fingerprint}"
            cfg = cfg.model_copy(update={"namespace": f"{base[:100]}-{run}"})
        elif not cfg.namespace:
            raise ValueError(
                f"store.namespace is unset and the {self.layout.world} ranks have no torch.distributed "
                "process group to agree on a run id: call torch.distributed.init_process_group before creating the "
                "DynLoader, or set dyn_plugin.store.namespace to an id unique to this run"
            )
        rank = self.layout.rank_of(self.stage, self.column) * self.tp + self.replica
        self._store = open_store(cfg, rank=rank, world_size=self.layout.world * self.tp)
        # planner processes connect to the very port the host bound (it may have picked a free one)
        self._store_cfg = cfg.model_copy(update={"port": self._store.port}) if cfg.backend == "tcp" else cfg
        self._finalizer = weakref.finalize(self, _close, self._store)

    def _agree_run_id(self) -> str | None:
        """A random id every rank of this run shares: rank 0 draws it and every rank takes it from a
        gather (on ``self.device``, as the backend needs) that also compares the ranks' planning code
        (``build``) before they share any plan. None when several ranks have no process group."""
        import torch.distributed as dist

        token = int.from_bytes(os.urandom(7), "little")  # 56 bits: fits an int64 tensor
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            mine = torch.tensor([token, _as_int63(hashlib.sha256(build().encode()).hexdigest())], dtype=torch.int64)
            rows = torch.empty(dist.get_world_size() * 2, dtype=torch.int64, device=self.device)
            dist.all_gather_single(rows, mine.to(self.device))
            rows = rows.view(-1, 2).tolist()
            if any(row[1] != rows[0][1] for row in rows):
                raise PlanMismatch(_builds_differ())
            token = rows[0][0]
        elif self.layout.world > 1:
            return None
        return f"{token:014x}"

    def _start_planners(self) -> None:
        from .planner_pool import CURSOR_KEY, ERROR_KEY, PlannerPool

        position = self.context.position(self.epoch, self.step)
        self._store.put(CURSOR_KEY, str(position).encode())
        plan_cfg = self.config.loader
        store, limit = self._store, self.config.store.max_payload_bytes  # not self: the pool must not hold the loader
        self._pool = PlannerPool(
            self.context.to_json(),
            self._store_cfg.model_dump_json(exclude_unset=True),
            num_planners=plan_cfg.planners,
            prefetch=plan_cfg.prefetch,
            start=position,
            world_size=self.layout.world * self.tp,
            on_failure=lambda why: store.put(ERROR_KEY, _within(why, limit)),
        )
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _close, self._store, self._pool)

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
        epoch = self.epoch
        while self.epoch == epoch and self.step < len(self.context.batches(epoch)):
            self._check_plans(block=False, settle=self.step - GIVE_UP_LAG)
            self._raise_if_given_up(self.step - GIVE_UP_LAG)
            rank_plan = self._plan(epoch, self.step)
            self._check_plans(block=False)
            self._start_check(rank_plan)
            if not self._checked_first:  # a mismatch shows at once, before a first step could hang
                self._check_plans(block=True)
                self._checked_first = True
            # Counted as consumed once handed out: state_dict() taken after training on this step
            # resumes at the next one.
            self.step += 1
            yield self._build(rank_plan)
        self._check_plans(block=True)
        self._raise_if_given_up(None)
        if self.epoch == epoch:
            self.epoch, self.step = epoch + 1, 0

    def _start_check(self, rp: RankPlan) -> None:
        """All-gather this step's digest and fingerprints without waiting for the result."""
        import torch.distributed as dist

        if not _agreeing():
            return
        world = dist.get_world_size()
        health = self._health
        row = [_as_int63(rp.digest), *self._local_fingerprints, GAVE_UP * health.gave_up + REJECTED * health.rejected]
        local = torch.tensor(row, dtype=torch.int64)
        if self.device.type == "cuda":  # from pinned memory, so the copy does not wait for the device either
            local = local.pin_memory().to(self.device, non_blocking=True)
        gathered = torch.empty(world * ROW, dtype=torch.int64, device=self.device)
        work = dist.all_gather_single(gathered, local, async_op=True)
        event = None
        if gathered.is_cuda:
            # the copy waits on the gather on the device; the host only ever asks the event
            work.wait()
            host = torch.empty(gathered.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            gathered = host
        self._checks.append((rp.epoch, rp.step, work, event, gathered))

    def _check_plans(self, *, block: bool, settle: int = -1) -> None:
        """Compare the gathered plans, oldest first; unless ``block``, wait only for those of steps up
        to ``settle`` and stop at a later one not gathered yet. Records the first rank(s) giving up."""
        while self._checks:
            epoch, step, work, event, gathered = self._checks[0]
            done = block or step <= settle
            if not done and not (event.query() if event is not None else work.is_completed()):
                return
            if event is not None:
                event.synchronize()
            else:
                work.wait()
            self._checks.popleft()
            rows = gathered.view(-1, ROW).tolist()
            checked = [row[: len(CHECKED)] for row in rows]
            if any(row != checked[0] for row in checked):
                build_at = CHECKED.index("dyn-plugin build")
                if any(row[build_at] != checked[0][build_at] for row in checked):
                    raise PlanMismatch(_builds_differ())  # every rank sees it, so every rank gathers the words
                raise PlanMismatch(_mismatch_message(epoch, step, checked))
            for reason in (REJECTED, GAVE_UP):
                quitting = [r for r, row in enumerate(rows) if row[-1] & reason]
                if quitting and self._health.given_up is None:
                    self._health.given_up = (epoch, step, quitting, reason)

    def _raise_if_given_up(self, due: int | None) -> None:
        """Raise, alike on every rank, when a rank gave up on the store, or rejected a plan from it, at
        a step up to ``due`` of this epoch (None: any step): every rank has waited for that step's check by now."""
        given = self._health.given_up
        if given is None or (due is not None and given[1] > due):
            return
        from ..store import PayloadError, StoreUnavailable

        epoch, step, ranks, reason = given
        if reason == REJECTED:
            raise PayloadError(
                f"rank(s) {ranks} read a plan of epoch {epoch} step {step} from the plan store at "
                f"{self._store.address} that failed its check (HMAC signature, size or schema: forged, altered, or "
                "signed with another secret; that rank's log names the key); every rank stops at this step: give "
                "every rank and planner the same store.secret_env secret, and check what else writes to the store"
            )
        raise StoreUnavailable(
            f"the plan store at {self._store.address} did not answer for loader.plan_timeout_s = "
            f"{self.config.loader.plan_timeout_s:g} s (rank(s) {ranks} gave up at epoch {epoch} step {step}); every "
            "rank stops at this step: check the store is up and reachable from every rank, or raise "
            "loader.plan_timeout_s to ride out longer outages"
        )

    def _plan(self, epoch: int, step: int) -> RankPlan:
        t0 = time.perf_counter()
        rp = self._plan_here(epoch, step) if self._store is None else self._checked_plan_from_store(epoch, step)
        self.plan_wait_s.append(time.perf_counter() - t0)
        return rp

    def _checked_plan_from_store(self, epoch: int, step: int) -> RankPlan:
        """A plan from the store that fails its check here is not raised alone, which would leave the
        other ranks inside the step's first collective: this rank plans the step itself (the same plan)
        and says so in its plan checks, and every rank raises ``GIVE_UP_LAG`` steps later. Where plans
        cannot be remade here (``strategy.ilp_time_budget_ms``) it raises at once."""
        from ..store import PayloadError

        try:
            return self._plan_from_store(epoch, step)
        except PayloadError as exc:
            if not (self._remakeable and _agreeing()):
                raise
            self._health.rejected = True
            logger.error(
                "%s; planning epoch %d step %d on this rank (the same plan), and every rank stops %d steps from now",
                exc,
                epoch,
                step,
                GIVE_UP_LAG,
            )
            return self._plan_here(epoch, step)

    def _plan_here(self, epoch: int, step: int) -> RankPlan:
        return self.context.plan(epoch, step)[(self.column, self.stage)]

    def _plan_from_store(self, epoch: int, step: int) -> RankPlan:
        """This rank's plan as the planners published it, or made here when they cannot give it (the
        module docstring's Faults)."""
        from ..store import StoreTimeout, StoreUnavailable
        from ..store.payload import decode
        from .planner_pool import CURSOR_KEY, plan_key
        from .planning import RANK_PLAN_SCHEMA

        position = self.context.position(epoch, step)
        if self.is_host and self._pool is None:
            self._start_planners()
        key = plan_key(position, self.column, self.stage, self.replica)
        health, owner = self._health, position % self.config.loader.planners
        start = time.monotonic()
        late, deadline = start + self.config.loader.plan_late_s, start + self.config.loader.plan_timeout_s
        while True:  # in short waits, so a planner's death (any rank may learn of it) ends this at once
            tried = time.monotonic()
            if health.down_since is not None and tried - health.probed < OUTAGE_PROBE_S:
                if self._remakeable:
                    return self._plan_here(epoch, step)
                time.sleep(OUTAGE_PROBE_S - (tried - health.probed))
                continue
            try:
                if self.is_host:  # at every poll: the cursor (it has the store's TTL) must outlive slow
                    # planners, and a server restarted without its data needs it again
                    self._store.put(CURSOR_KEY, str(position).encode())
                if health.planners_failed or owner in health.stalled:
                    data = self._store.get(key)  # no waiting on a planner that exited or was found stopped
                else:
                    try:
                        data = self._store.wait(key, min(FAILURE_POLL_S, max(deadline - time.monotonic(), 1e-3)))
                    except StoreTimeout:
                        data = None
                if data is not None:
                    self._store.delete(key)
                plan_here = data is None and self._plan_here_instead(epoch, step, key, owner, late, deadline)
            except StoreUnavailable as exc:
                self._store_down(exc, tried)
                if self._remakeable:
                    return self._plan_here(epoch, step)
                continue
            if health.down_since is not None:
                logger.warning(
                    "the plan store at %s answers again after %.1f s", self._store.address, tried - health.down_since
                )
                health.down_since, health.warned_lost = None, False
            if plan_here:
                return self._plan_here(epoch, step)
            if data is not None:
                health.served = True
                break
        meta, _ = decode(data, max_bytes=int(self.config.store.max_payload_mb * 2**20), schema=RANK_PLAN_SCHEMA)
        rp = RankPlan.from_meta(meta)
        if (rp.epoch, rp.step) != (epoch, step):
            raise RuntimeError(
                f"store key {key} held the plan of epoch {rp.epoch} step {rp.step}, "
                f"expected epoch {epoch} step {step}: another run shares the store namespace"
            )
        return rp

    def _plan_here_instead(self, epoch: int, step: int, key: str, owner: int, late: float, deadline: float) -> bool:
        """Whether this rank plans the step itself, its plan not (yet) in a store that answers; raises
        where it cannot and must not wait longer. ``owner``: the planner that owes the plan."""
        from ..store import StoreTimeout
        from .planner_pool import CURSOR_KEY, ERROR_KEY, PlannerError, progress_key

        health = self._health
        if health.planners_failed:
            return True
        position = self.context.position(epoch, step)
        if not self.is_host and self._store.get(CURSOR_KEY) is None:
            # a server restarted without its data lost the cursor the planners need, and the host may
            # be inside a collective, waiting for this rank
            self._store.put(CURSOR_KEY, str(position).encode())
        where = f"rank (column {self.column}, stage {self.stage}) waiting for the plan of epoch {epoch} step {step}"
        why = self._store.get(ERROR_KEY)
        if why is not None:
            if not self._remakeable:
                raise PlannerError(f"{where}: {why.decode(errors='replace')}")
            health.planners_failed = True
            logger.warning(
                "%s: %s; planning on this rank each step whose plan is not in the store already (plans are "
                "deterministic: the same plans)",
                where,
                why.decode(errors="replace"),
            )
            return True
        progress = [self._store.get(progress_key(k)) for k in range(self.config.loader.planners)]
        if all(p is not None and int(p) >= position for p in progress):
            self._lost(epoch, step, key)  # published, so it expired or the server lost it
            return True
        if owner in health.stalled:
            if progress[owner] == health.stalled[owner]:
                return True  # still where it stopped
            del health.stalled[owner]
            logger.warning("planner process %d publishes again: waiting for its plans again", owner)
        now = time.monotonic()
        if self._remakeable and health.served and now >= late:
            health.stalled[owner] = progress[owner]
            logger.warning(
                "%s: planner process %d has not published it after %g s (loader.local_plan_after_s) though the "
                "store at %s answers: it is stopped or overloaded; planning on this rank (plans are deterministic: "
                "the same plan), and without waiting on that planner until it publishes again",
                where,
                owner,
                self.config.loader.plan_late_s,
                self._store.address,
            )
            return True
        if now >= deadline:
            raise StoreTimeout(
                f"no plan for epoch {epoch} step {step} under '{key}' on {self._store.address} "
                f"after {self.config.loader.plan_timeout_s:g} s (loader.plan_timeout_s); the planner processes run "
                "on the rank at stage 0, column 0: check it is alive and not overloaded"
            )
        return False

    def _lost(self, epoch: int, step: int, key: str) -> None:
        """The planners published this rank's plan under ``key``, but it is gone: say so once per
        outage, or refuse where it cannot be remade identically."""
        gone = (
            f"the plan of epoch {epoch} step {step} under '{key}' on {self._store.address} was published but is "
            f"gone: it expired (store.ttl_s = {self.config.store.ttl_s:g} s) or the server lost it"
        )
        if not self._remakeable:
            raise RuntimeError(
                f"{gone}; plans solved under strategy.ilp_time_budget_ms cannot be remade identically on this "
                "rank: raise store.ttl_s above the longest pause in training, or unset ilp_time_budget_ms"
            )
        if not self._health.warned_lost:
            self._health.warned_lost = True
            logger.warning("%s; planning it on this rank (plans are deterministic: the same plan)", gone)

    def _store_down(self, exc: Exception, tried: float) -> None:
        """The store did not answer a try begun at ``tried``: start (or go on with) the outage; once
        it has lasted plan_timeout_s, give up: at once without a process group to agree through (or
        without local plans), else alike on every rank a few steps later (_raise_if_given_up)."""
        from ..store import StoreUnavailable

        health, timeout = self._health, self.config.loader.plan_timeout_s
        health.probed = time.monotonic()
        if health.down_since is None:
            health.down_since = tried
            logger.warning(
                "%s; %s, and every rank stops if it stays down for loader.plan_timeout_s = %g s",
                exc,
                "planning on this rank while it is down (plans are deterministic: the same plans)"
                if self._remakeable
                else "waiting for it (plans solved under strategy.ilp_time_budget_ms cannot be remade here)",
                timeout,
            )
        down = health.probed - health.down_since
        if down < timeout or health.gave_up:
            return
        if self._remakeable and _agreeing():
            health.gave_up = True
            logger.error("the plan store at %s has not answered for %.1f s: giving up", self._store.address, down)
            return
        raise StoreUnavailable(
            f"the plan store at {self._store.address} has not answered for {down:.1f} s, beyond "
            f"loader.plan_timeout_s = {timeout:g} s (last error: {exc}); check the store is up and reachable "
            "from every rank, or raise loader.plan_timeout_s to ride out longer outages"
        ) from None

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
            rp.epoch, rp.step, rp.plan, tensors, ids, rp.scored_tokens, rp.digest, rp.predicted_ms, rp.predicted_peak_mb
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
                "loader state was saved for different lengths, seed or token budget; "
                "resume with the same dataset and dyn_plugin config"
            )
        epoch, step, columns = int(state["epoch"]), int(state["step"]), int(state["columns"])
        if columns != self.layout.columns and step > 0:
            mb = self.config.microbatching
            saved = epoch_batches(self.lengths, mb.global_tokens, seed=self.seed, epoch=epoch, min_sequences=columns)
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

    @property
    def position(self) -> int:
        """Global batches handed out since the run began (over every epoch): orders checkpoints."""
        return self.context.position(self.epoch, self.step)

    def _fingerprint(self, h: "hashlib._Hash") -> str:
        """``h``: the lengths' sha256, extended here; computed once (state_dict() runs at every checkpoint).
        The layout is not in it: ``load_state_dict`` judges a change of data-parallel size itself."""
        h.update(repr((self.seed, self.config.microbatching.global_tokens)).encode())
        return h.hexdigest()[:16]

    def close(self) -> None:
        """Stop whatever the loader started (planner processes, a store it hosts)."""
        if self._store is not None:
            self._finalizer()


def load_micro_batch(
    desc: PlannedMicroBatch, fetch: Callable[[int], Any], *, column: int, pad_id: int = 0
) -> dict[str, Any]:
    """The tensors of one planned micro-batch on the rank at data-parallel ``column``; ``fetch(i)``
    returns dataset item i. A plan of (input, target) pairs (``seq_lens`` of pairs) is padded per
    side (``collate_pairs``) or packed per side (``collate_packed_pairs``); sequences are built in
    the plan's layout and, under sequence parallelism, cut to this rank's shard."""
    if desc.seq_lens and not isinstance(desc.seq_lens[0], numbers.Integral):
        if desc.sp > 1:
            raise ValueError(
                f"a micro-batch of (input, target) pairs planned with sp {desc.sp}: pairs are built without sequence "
                "parallelism; plan them with sp 1"
            )
        build = collate_packed_pairs if desc.layout == "packed" else collate_pairs
        return build(desc.sample_ids, desc.seq_lens, desc.shape, fetch, pad_id=pad_id)
    batch = collate(desc.sample_ids, desc.seq_lens, desc.layout, desc.shape, fetch, pad_id=pad_id, sp=desc.sp)
    return shard(batch, desc.sp, column - desc.group) if desc.sp > 1 else batch


def _close(store, pool=None) -> None:
    """Never raises on a store gone away (server down, rank 0 exited): closing runs in ``finally``
    blocks and at garbage collection, where it would hide the error being handled."""
    from ..store import StoreError

    if pool is not None:
        pool.stopping()
        try:
            store.put(pool.stop_key, b"1")
        except StoreError as exc:
            logger.warning("could not publish the planners' stop key (%s); terminating them", exc)
        pool.close()
    store.close()


def _within(text: str, limit: int) -> bytes:
    """``text`` as UTF-8 in at most ``limit`` bytes: its start and its end (a planner's failure: which
    planner, and its traceback's last line, the error) around an ellipsis, when it does not fit."""
    data = text.encode()
    if len(data) <= limit:
        return data
    half = max(limit - 5, 0) // 2
    return data[:half] + b" ... " + data[len(data) - half :] if half else data[:limit]


def _agreeing() -> bool:
    """Whether ranks have a process group to check their plans through (and to agree on giving up)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _as_int63(hex_digest: str) -> int:
    return int(hex_digest[:16], 16) >> 1  # a non-negative int64


# where plans travel, not what they are (and a store URL may hold a password)
NOT_PLANNED = {"store", "loader", "checkpoint", "start_check"}


def plan_config_digest(config: DynPluginConfig) -> str:
    """The sha256 (hex) of the config as the plans depend on it: ``NOT_PLANNED`` left out."""
    return hashlib.sha256(config.model_dump_json(exclude=NOT_PLANNED).encode()).hexdigest()


def _fingerprints(
    lengths_hash: bytes, cost: TableCostModel | EncoderDecoderCostModel, config: DynPluginConfig, sizes: tuple
) -> list[int]:
    """Fingerprints of what a plan depends on, in CHECKED order after the digest (the config's as
    ``plan_config_digest`` sees it)."""
    parts = [
        lengths_hash,
        # the encoder-decoder cost model has no JSON form: its fitted tables, pickled, are as exact
        json.dumps(cost.to_dict(), sort_keys=True).encode() if hasattr(cost, "to_dict") else pickle.dumps(cost),
        (plan_config_digest(config) + repr(sizes)).encode(),
        build().encode(),
    ]
    return [_as_int63(hashlib.sha256(p).hexdigest()) for p in parts]


def _builds_differ() -> str:
    """Which planning code each rank runs, gathered (every rank calls it), as a refusal."""
    import torch.distributed as dist

    builds: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(builds, build())
    ranks = "; ".join(f"rank {r}: {b}" for r, b in enumerate(builds))
    return (
        f"the ranks run different planning code ({ranks}), which may plan the same step differently; install "
        "the same dyn-plugin on every rank, with its C++ extension built on each (or on none)"
    )


def _mismatch_message(epoch: int, step: int, rows: list[list[int]]) -> str:
    """Which ranks disagree with rank 0, on what, and the likely cause."""
    odd = [r for r, row in enumerate(rows) if row != rows[0]]
    differs = [name for i, name in enumerate(CHECKED) if i and any(row[i] != rows[0][i] for row in rows)]
    lines = [f"ranks disagree on the plan of epoch {epoch} step {step}: rank(s) {odd} differ from rank 0"]
    for i, name in enumerate(CHECKED):
        values = ", ".join(f"rank {r}: {row[i]:016x}" for r, row in enumerate(rows))
        lines.append(f"  {name}: {values}")
    if differs:
        lines.append(
            f"likely cause: different {' and '.join(differs)} on those ranks; give every rank the same "
            "dataset lengths, profile/cost model and dyn_plugin config"
        )
    else:
        lines.append(
            "likely cause: the same lengths, cost model and config planned differently: check every rank "
            "runs the same dyn-plugin version and C++ extension build"
        )
    return "\n".join(lines)
