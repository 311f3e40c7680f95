"""DynLoader: a drop-in for a torch DataLoader that yields one planned optimizer step at a time.

    loader = DynLoader(dataset, lengths=lengths, config=cfg, cost_model=cm,
                       dp_rank=r, dp_size=n, pp_rank=s, pp_size=k, seed=1234)
    for step in loader:
        step.micro_batches   # this rank's micro-batches, in execution order (dicts of tensors)
        step.plan            # this rank's execution plan
        step.scored_tokens   # scored tokens of the whole global batch: divide summed losses by it

Without a store every rank plans each global batch itself; plans are deterministic, so ranks
agree without talking (DCP's way). With a store (``store`` section), background planner
processes plan ahead and each rank reads only its own plan (see planner_pool.py).

Exactly once: an epoch's global batches partition the samples and every sample of a global
batch goes to exactly one replica's micro-batches (pipeline stages of one replica share them).
``state_dict()`` after any step and ``load_state_dict()`` on a fresh loader resume at the next
global batch, with the same plans.
"""
from __future__ import annotations

import hashlib
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from ..config import DynPluginConfig, LoadedConfig, load_config
from ..cost.table import TableCostModel
from ..lengths.io import cap_lengths, validate_lengths
from ..plan.instructions import ExecutionPlan
from .collate import collate
from .planning import PlanningContext, RankPlan

STATE_VERSION = 1


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

    @property
    def loaded(self) -> list[dict]:
        """The plan's description (sample_ids, seq_lens, layout, recompute, shape) of each entry
        of ``micro_batches``, in the same order."""
        return [self.plan.micro_batches[m] for m in self.plan.loads]


class DynLoader:
    def __init__(
        self,
        dataset: Sequence[Any],
        *,
        lengths: Sequence[int],
        config: DynPluginConfig | LoadedConfig | str | os.PathLike | Mapping,
        cost_model: TableCostModel,
        dp_rank: int = 0,
        dp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int | None = None,
        seed: int = 0,
        zero_stage: int | None = None,
        tp: int = 1,
        pad_id: int = 0,
    ) -> None:
        if not isinstance(config, (DynPluginConfig, LoadedConfig)):
            config = load_config(config)
        if isinstance(config, LoadedConfig):
            zero_stage = config.zero_stage if zero_stage is None else zero_stage
            config = config.plugin
        self.config = config
        pp_size = pp_size or config.pipeline.stages
        if pp_size != config.pipeline.stages:
            raise ValueError(f"pp_size = {pp_size} but dyn_plugin.pipeline.stages = {config.pipeline.stages}; they must match")
        if not (0 <= dp_rank < dp_size and 0 <= pp_rank < pp_size):
            raise ValueError(f"rank out of range: dp_rank {dp_rank} of {dp_size}, pp_rank {pp_rank} of {pp_size}")
        self.dataset = dataset
        self.dp_rank, self.dp_size, self.pp_rank, self.pp_size = dp_rank, dp_size, pp_rank, pp_size
        self.seed, self.pad_id = seed, pad_id
        self.lengths = self._checked_lengths(lengths)
        self.context = PlanningContext(config, cost_model, self.lengths, dp_size, pp_size, zero_stage or 0, tp, seed)
        self.epoch, self.step = 0, 0
        self.plan_wait_s: list[float] = []  # per step, how long this rank waited for its plan
        self._store = self._pool = None
        if config.store.backend != "none":
            self._open_store()

    @property
    def is_host(self) -> bool:
        """The rank that hosts the embedded store and the planner processes."""
        return self.dp_rank == 0 and self.pp_rank == 0

    def _open_store(self) -> None:
        from ..store import open_store

        cfg = self.config.store
        if not cfg.namespace:
            run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "local")
            cfg = cfg.model_copy(update={"namespace": f"{run}-{self._fingerprint()}"})
        world = self.dp_size * self.pp_size
        self._store = open_store(cfg, rank=self.pp_rank * self.dp_size + self.dp_rank, world_size=world)
        # planner processes connect to the very port the host bound (it may have picked a free one)
        self._store_cfg = cfg.model_copy(update={"port": self._store.port}) if cfg.backend == "tcp" else cfg
        self._finalizer = weakref.finalize(self, _close, self._store)

    def _start_planners(self) -> None:
        from .planner_pool import CURSOR_KEY, PlannerPool

        position = self.context.position(self.epoch, self.step)
        self._store.put(CURSOR_KEY, str(position).encode())
        plan_cfg = self.config.loader
        self._pool = PlannerPool(self.context.to_json(), self._store_cfg.model_dump_json(exclude_unset=True),
                                 num_planners=plan_cfg.planners, prefetch=plan_cfg.prefetch, start=position,
                                 world_size=self.dp_size * self.pp_size)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _close, self._store, self._pool)

    def _checked_lengths(self, lengths: Sequence[int]) -> np.ndarray:
        arr = validate_lengths(lengths)
        if len(arr) != len(self.dataset):
            raise ValueError(f"lengths has {len(arr)} entries but the dataset has {len(self.dataset)} samples; "
                             "give one length (token count) per sample")
        mb = self.config.microbatching
        arr = cap_lengths(arr, mb.max_seq_len, mb.truncate)
        return arr

    def __len__(self) -> int:
        """Global batches left in the current epoch."""
        return len(self.context.batches(self.epoch)) - self.step

    def __iter__(self) -> Iterator[Step]:
        """The rest of the current epoch; the next iteration starts the next epoch."""
        epoch = self.epoch
        while self.epoch == epoch and self.step < len(self.context.batches(epoch)):
            rank_plan = self._plan(epoch, self.step)
            # Counted as consumed once handed out: state_dict() taken after training on this step
            # resumes at the next one.
            self.step += 1
            yield self._build(rank_plan)
        if self.epoch == epoch:
            self.epoch, self.step = epoch + 1, 0

    def _plan(self, epoch: int, step: int) -> RankPlan:
        t0 = time.perf_counter()
        if self._store is None:
            rp = self.context.plan(epoch, step)[(self.dp_rank, self.pp_rank)]
        else:
            rp = self._plan_from_store(epoch, step)
        self.plan_wait_s.append(time.perf_counter() - t0)
        return rp

    def _plan_from_store(self, epoch: int, step: int) -> RankPlan:
        from ..store import StoreTimeout
        from ..store.payload import decode
        from .planner_pool import CURSOR_KEY, plan_key
        from .planning import RANK_PLAN_SCHEMA

        position = self.context.position(epoch, step)
        if self.is_host:
            if self._pool is None:
                self._start_planners()
            self._store.put(CURSOR_KEY, str(position).encode())
        key = plan_key(position, self.dp_rank, self.pp_rank)
        try:
            data = self._store.wait(key, self.config.loader.plan_timeout_s)
        except StoreTimeout as exc:
            why = self._pool.failed() if self._pool is not None else None
            raise StoreTimeout(f"{exc}{'; ' + why if why else ''}") from None
        self._store.delete(key)
        meta, _ = decode(data, max_bytes=int(self.config.store.max_payload_mb * 2**20), schema=RANK_PLAN_SCHEMA)
        rp = RankPlan.from_meta(meta)
        if (rp.epoch, rp.step) != (epoch, step):
            raise RuntimeError(f"store key {key} held the plan of epoch {rp.epoch} step {rp.step}, "
                               f"expected epoch {epoch} step {step}: another run shares the store namespace")
        return rp

    def _build(self, rp: RankPlan) -> Step:
        tensors, ids = [], []
        for m in rp.plan.loads:
            desc = rp.plan.micro_batches[m]
            tensors.append(collate(desc["sample_ids"], desc["seq_lens"], desc["layout"], desc["shape"],
                                   self.dataset.__getitem__, pad_id=self.pad_id))
            ids.append(list(desc["sample_ids"]))
        return Step(rp.epoch, rp.step, rp.plan, tensors, ids, rp.scored_tokens, rp.digest, rp.predicted_ms)

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "epoch": self.epoch, "step": self.step, "seed": self.seed,
                "fingerprint": self._fingerprint()}

    def load_state_dict(self, state: Mapping) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r}; this dyn-plugin reads {STATE_VERSION}")
        if state["fingerprint"] != self._fingerprint():
            raise ValueError("loader state was saved for different lengths, seed, token budget or parallel sizes; "
                             "resume with the same dataset and dyn_plugin config")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])

    def _fingerprint(self) -> str:
        h = hashlib.sha256(self.lengths.tobytes())
        h.update(repr((self.seed, self.config.microbatching.global_tokens, self.dp_size, self.pp_size)).encode())
        return h.hexdigest()[:16]

    def close(self) -> None:
        """Stop whatever the loader started (planner processes, a store it hosts)."""
        if self._store is not None:
            self._finalizer()


def _close(store, pool=None) -> None:
    from .planner_pool import STOP_KEY

    if pool is not None:
        try:
            store.put(STOP_KEY, b"1")
        finally:
            pool.close()
    store.close()
