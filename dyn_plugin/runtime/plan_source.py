"""Where a rank's plans come from: planned here, or read from the store the planner processes fill.

Without a store every rank plans each global batch itself; plans are deterministic, so ranks
agree without talking (DCP's way). With a store (``store`` section), background planner
processes plan ahead and each rank reads only its own plan (see planner_pool.py). The loader
owns one :class:`PlanSource`; it opens the store (under a run id every rank agrees on), starts
the planners on the host rank and stops both when closed or garbage-collected.

Faults, with a store: a plan the planners cannot give is made on the waiting rank, and it is the
same plan (plans are deterministic in (epoch, step) and the planning context), so ranks need not
agree on who planned what: a planner that exited, one late by ``loader.local_plan_after_s`` (stopped,
frozen; the rank then stops waiting on it until it publishes again), a plan the store lost (expired,
a server restarted without its data) and a store that does not answer. A store down for
``loader.plan_timeout_s`` ends the run on every rank at the same step (plan_agreement.py: the rank
that gives up says so in its next plan check). Under ``strategy.ilp_time_budget_ms`` plans cannot be
remade identically: ranks wait and fail instead.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass, field

import torch

from ..config import DynPluginConfig
from ..layout import RankLayout
from .plan_agreement import GIVE_UP_LAG, PlanMismatch, agreeing, build_fingerprint, builds_differ
from .planning import PlanningContext, RankPlan

logger = logging.getLogger(__name__)

# How often a rank waiting for its plan looks for a planner failure another process published.
FAILURE_POLL_S = 0.25
# While the store is down a rank plans each step itself and tries the store at most this often:
# a try can take store.timeout_s, which no step should pay every time.
OUTAGE_PROBE_S = 1.0


@dataclass
class _StoreHealth:
    """What a rank knows, between steps, of the store and the planners behind it."""

    down_since: float | None = None  # when this rank's first failed try of this outage began
    probed: float = 0.0  # when it last tried the store during the outage
    gave_up: bool = False  # down for plan_timeout_s: said in every later plan check
    rejected: bool = False  # a plan from the store failed its check here: said in every later plan check
    stalled: dict[int, bytes | None] = field(default_factory=dict)  # planner -> its progress when found late
    planners_failed: bool = False  # a planner exited: every step is planned here unless its plan is there
    served: bool = False  # a plan came from the store: the planners started, so a late plan is late
    warned_lost: bool = False  # plans the store lost are reported once per outage


class PlanSource:
    """This rank's plans, from the store when the config names one, else planned here. Its store
    and planner processes are stopped by ``close()`` or when it is garbage-collected: the loader
    holds the only reference, and nothing the store or the pool holds refers back to it."""

    def __init__(
        self,
        config: DynPluginConfig,
        context: PlanningContext,
        layout: RankLayout,
        *,
        stage: int,
        column: int,
        replica: int,
        device: torch.device,
        data_fingerprint: str,
    ) -> None:
        """``stage``, ``column``, ``replica``: this rank's place (the layout's ``tp`` ranks share each cell's plan);
        ``device``: where the run-id gather runs; ``data_fingerprint``: names the store namespace
        when ``store.namespace`` is unset."""
        self.config, self.context, self.layout = config, context, layout
        self.stage, self.column, self.replica = stage, column, replica
        self.device = device
        self.store = self.pool = None
        self.health = _StoreHealth()
        st = config.strategy
        # a wall-clock limit makes a solve depend on the machine's load: another process may plan otherwise
        self._remakeable = not (st.enabled and st.ilp_time_budget_ms is not None)
        if config.store.backend != "none":
            self._open_store(data_fingerprint)

    @property
    def is_host(self) -> bool:
        """The rank that hosts the embedded store and the planner processes."""
        return self.column == 0 and self.stage == 0 and self.replica == 0

    def _open_store(self, data_fingerprint: str) -> None:
        from ..store import open_store

        cfg = self.config.store
        run = self._agree_run_id()
        if run is not None:
            # a fresh id per run under the configured (or a derived) prefix: nothing an earlier run
            # left in the store (plans, a stop key, a failure) is ever read by this one
            base = cfg.namespace or f"run-{data_fingerprint}"
            cfg = cfg.model_copy(update={"namespace": f"{base[:100]}-{run}"})
        elif not cfg.namespace:
            raise ValueError(
                f"store.namespace is unset and the {self.layout.world} ranks have no torch.distributed "
                "process group to agree on a run id: call torch.distributed.init_process_group before creating the "
                "DynLoader, or set dyn_plugin.store.namespace to an id unique to this run"
            )
        rank = self.layout.rank_of(self.stage, self.column, self.replica)
        self.store = open_store(cfg, rank=rank, world_size=self.layout.world)
        # planner processes connect to the very port the host bound (it may have picked a free one)
        self._store_cfg = cfg.model_copy(update={"port": self.store.port}) if cfg.backend == "tcp" else cfg
        self._finalizer = weakref.finalize(self, _close, self.store)

    def _agree_run_id(self) -> str | None:
        """A random id every rank of this run shares: rank 0 draws it and every rank takes it from a
        gather (on ``self.device``, as the backend needs) that also compares the ranks' planning code
        (``build``) before they share any plan. None when several ranks have no process group."""
        import torch.distributed as dist

        token = int.from_bytes(os.urandom(7), "little")  # 56 bits: fits an int64 tensor
        if agreeing():
            mine = torch.tensor([token, build_fingerprint()], dtype=torch.int64)
            rows = torch.empty(dist.get_world_size() * 2, dtype=torch.int64, device=self.device)
            dist.all_gather_single(rows, mine.to(self.device))
            rows = rows.view(-1, 2).tolist()
            if any(row[1] != rows[0][1] for row in rows):
                raise PlanMismatch(builds_differ())
            token = rows[0][0]
        elif self.layout.world > 1:
            return None
        return f"{token:014x}"

    def start_planners(self, position: int) -> None:
        """Start the planner processes (the host rank does, at its first plan), planning from run
        ``position`` on."""
        from .planner_pool import CURSOR_KEY, ERROR_KEY, PlannerPool

        self.store.put(CURSOR_KEY, str(position).encode())
        plan_cfg = self.config.loader
        store, limit = self.store, self.config.store.max_payload_bytes  # not self: the pool must not hold the source
        self.pool = PlannerPool(
            self.context.to_json(),
            self._store_cfg.model_dump_json(exclude_unset=True),
            num_planners=plan_cfg.planners,
            prefetch=plan_cfg.prefetch,
            start=position,
            world_size=self.layout.world,
            on_failure=lambda why: store.put(ERROR_KEY, _within(why, limit)),
        )
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _close, self.store, self.pool)

    def plan(self, epoch: int, step: int) -> RankPlan:
        """This rank's plan of global batch ``step`` of ``epoch``."""
        return self._plan_here(epoch, step) if self.store is None else self._checked_plan_from_store(epoch, step)

    def _checked_plan_from_store(self, epoch: int, step: int) -> RankPlan:
        """A plan from the store that fails its check here is not raised alone, which would leave the
        other ranks inside the step's first collective: this rank plans the step itself (the same plan)
        and says so in its plan checks, and every rank raises ``GIVE_UP_LAG`` steps later. Where plans
        cannot be remade here (``strategy.ilp_time_budget_ms``) it raises at once."""
        from ..store import PayloadError

        try:
            rp = self._plan_from_store(epoch, step)
        except PayloadError as exc:
            if not (self._remakeable and agreeing()):
                raise
            self.health.rejected = True
            logger.error(
                "%s; planning epoch %d step %d on this rank (the same plan), and every rank stops %d steps from now",
                exc,
                epoch,
                step,
                GIVE_UP_LAG,
            )
            return self._plan_here(epoch, step)
        version = self.context.calibration_at(self.context.position(epoch, step)).version
        if rp.calibration != version:
            # planned ahead before a calibration that prices this step (a rise of the memory factor
            # prices the next step at once): every rank holds the same versions, so every rank makes
            # this step's plan itself, the same one, rather than run one the newer model says may not fit
            logger.info(
                "epoch %d step %d: the planners priced it with calibration v%d, it is priced by v%d: planned here",
                epoch,
                step,
                rp.calibration,
                version,
            )
            return self._plan_here(epoch, step)
        return rp

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
        if self.is_host and self.pool is None:
            self.start_planners(position)
        key = plan_key(position, self.column, self.stage, self.replica)
        health, owner = self.health, position % self.config.loader.planners
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
                    self.store.put(CURSOR_KEY, str(position).encode())
                if health.planners_failed or owner in health.stalled:
                    data = self.store.get(key)  # no waiting on a planner that exited or was found stopped
                else:
                    try:
                        data = self.store.wait(key, min(FAILURE_POLL_S, max(deadline - time.monotonic(), 1e-3)))
                    except StoreTimeout:
                        data = None
                if data is not None:
                    self.store.delete(key)
                plan_here = data is None and self._plan_here_instead(epoch, step, key, owner, late, deadline)
            except StoreUnavailable as exc:
                self._store_down(exc, tried)
                if self._remakeable:
                    return self._plan_here(epoch, step)
                continue
            if health.down_since is not None:
                logger.warning(
                    "the plan store at %s answers again after %.1f s", self.store.address, tried - health.down_since
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

        health = self.health
        if health.planners_failed:
            return True
        position = self.context.position(epoch, step)
        if not self.is_host and self.store.get(CURSOR_KEY) is None:
            # a server restarted without its data lost the cursor the planners need, and the host may
            # be inside a collective, waiting for this rank
            self.store.put(CURSOR_KEY, str(position).encode())
        where = f"rank (column {self.column}, stage {self.stage}) waiting for the plan of epoch {epoch} step {step}"
        why = self.store.get(ERROR_KEY)
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
        progress = [self.store.get(progress_key(k)) for k in range(self.config.loader.planners)]
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
                self.store.address,
            )
            return True
        if now >= deadline:
            raise StoreTimeout(
                f"no plan for epoch {epoch} step {step} under '{key}' on {self.store.address} "
                f"after {self.config.loader.plan_timeout_s:g} s (loader.plan_timeout_s); the planner processes run "
                "on the rank at stage 0, column 0: check it is alive and not overloaded"
            )
        return False

    def _lost(self, epoch: int, step: int, key: str) -> None:
        """The planners published this rank's plan under ``key``, but it is gone: say so once per
        outage, or refuse where it cannot be remade identically."""
        gone = (
            f"the plan of epoch {epoch} step {step} under '{key}' on {self.store.address} was published but is "
            f"gone: it expired (store.ttl_s = {self.config.store.ttl_s:g} s) or the server lost it"
        )
        if not self._remakeable:
            raise RuntimeError(
                f"{gone}; plans solved under strategy.ilp_time_budget_ms cannot be remade identically on this "
                "rank: raise store.ttl_s above the longest pause in training, or unset ilp_time_budget_ms"
            )
        if not self.health.warned_lost:
            self.health.warned_lost = True
            logger.warning("%s; planning it on this rank (plans are deterministic: the same plan)", gone)

    def _store_down(self, exc: Exception, tried: float) -> None:
        """The store did not answer a try begun at ``tried``: start (or go on with) the outage; once
        it has lasted plan_timeout_s, give up: at once without a process group to agree through (or
        without local plans), else alike on every rank a few steps later (plan_agreement.py)."""
        from ..store import StoreUnavailable

        health, timeout = self.health, self.config.loader.plan_timeout_s
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
        if self._remakeable and agreeing():
            health.gave_up = True
            logger.error("the plan store at %s has not answered for %.1f s: giving up", self.store.address, down)
            return
        raise StoreUnavailable(
            f"the plan store at {self.store.address} has not answered for {down:.1f} s, beyond "
            f"loader.plan_timeout_s = {timeout:g} s (last error: {exc}); check the store is up and reachable "
            "from every rank, or raise loader.plan_timeout_s to ride out longer outages"
        ) from None

    def close(self) -> None:
        """Stop whatever this source started (planner processes, a store it hosts)."""
        if self.store is not None:
            self._finalizer()


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
