"""Cross-rank plan agreement: every rank checks that the others hold the same plan for each step.

Agreement: when torch.distributed is initialized, every step's plan digest (with fingerprints
of the lengths, the cost model and the config) is all-gathered over the world, asynchronously
when the step is handed out, and checked when a later step is asked for (without waiting on the
device: a gather not finished yet is checked later) and, blocking, at the first step and at the
end of each epoch. Ranks that disagree raise :class:`PlanMismatch`, naming them and what differs.

Stopping together: a rank that gave up on the store (or rejected a plan from it: plan_source.py)
says so in its next plan check, and every rank waits for the check ``GIVE_UP_LAG`` steps old before
each step, so all of them raise there, none is left inside a collective the others never enter.

The loader owns one :class:`PlanAgreement` (its gathers in flight and the first stop gathered);
the store's run-id agreement (plan_source.py) compares the ranks' planning code through
``build_fingerprint`` and ``builds_differ`` before any plan is shared.
"""

from __future__ import annotations

import collections
import hashlib
import json
import pickle
from typing import TYPE_CHECKING, Any

import torch

from ..config import DynPluginConfig
from ..cost.encoder_decoder import EncoderDecoderCostModel
from ..cost.native import build
from ..cost.table import TableCostModel
from .planning import RankPlan

if TYPE_CHECKING:  # for a message only: the store is opened by plan_source.py
    from ..store import PlanStore

# What the ranks compare each step; the last three say why digests differ.
CHECKED = ("plan digest", "lengths", "cost model", "config", "dyn-plugin build")
# Each gathered row ends, after CHECKED, with this rank's reasons to stop every rank (bits):
GAVE_UP = 1  # it gave up on a store that stopped answering
REJECTED = 2  # a plan it read from the store failed its check (signature, size or schema)
ROW = len(CHECKED) + 1
# A rank's giving up is acted on this many steps later, when every rank waits for that step's check
# (two steps old: done long since, unless the host runs that far ahead of the device).
GIVE_UP_LAG = 2
# where plans travel, not what they are (and a store URL may hold a password)
NOT_PLANNED = {"store", "loader", "checkpoint", "start_check"}


class PlanMismatch(RuntimeError):
    """Ranks hold different plans for the same step."""


class PlanAgreement:
    """This rank's side of the per-step plan check: the gathers in flight, oldest first, and the
    first stop (a rank giving up on the store, or rejecting a plan from it) they brought."""

    def __init__(
        self,
        lengths_hash: bytes,
        cost_model: TableCostModel | EncoderDecoderCostModel,
        config: DynPluginConfig,
        sizes: tuple,
        device: torch.device,
    ) -> None:
        """``lengths_hash``: the sha256 of the capped lengths; ``sizes``: what else shapes the plans
        (seed, columns, stages, ZeRO stage, tp, state bytes); ``config``: fingerprinted as
        ``plan_config_digest`` sees it (and names loader.plan_timeout_s when the store gave out);
        ``device``: where the gathers run."""
        self.config, self.device = config, device
        self._checks: collections.deque = collections.deque()  # plan checks in flight, oldest first
        self._checked_first = False
        self._fingerprints = _fingerprints(lengths_hash, cost_model, config, sizes)
        # (epoch, step, ranks, reason bit) of the first stop gathered: every rank raises at that step
        self.given_up: tuple[int, int, list[int], int] | None = None

    def start_check(self, rp: RankPlan, *, gave_up: bool, rejected: bool) -> None:
        """All-gather this step's digest and fingerprints without waiting for the result; ``gave_up``
        and ``rejected``: this rank's reasons to stop every rank (plan_source.py's store health)."""
        import torch.distributed as dist

        if not agreeing():
            return
        world = dist.get_world_size()
        row = [_as_int63(rp.digest), *self._fingerprints, GAVE_UP * gave_up + REJECTED * rejected]
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

    def check_plans(self, *, block: bool, settle: int = -1) -> None:
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
                    raise PlanMismatch(builds_differ())  # every rank sees it, so every rank gathers the words
                raise PlanMismatch(_mismatch_message(epoch, step, checked))
            for reason in (REJECTED, GAVE_UP):
                quitting = [r for r, row in enumerate(rows) if row[-1] & reason]
                if quitting and self.given_up is None:
                    self.given_up = (epoch, step, quitting, reason)

    def check_first(self) -> None:
        """Wait for the first step's check: a mismatch shows at once, before a first step could hang."""
        if not self._checked_first:
            self.check_plans(block=True)
            self._checked_first = True

    def raise_if_given_up(self, due: int | None, store: PlanStore | None) -> None:
        """Raise, alike on every rank, when a rank gave up on the store, or rejected a plan from it, at
        a step up to ``due`` of this epoch (None: any step): every rank has waited for that step's check by now.
        ``store``: the plan store the message names."""
        given = self.given_up
        if given is None or (due is not None and given[1] > due):
            return
        from ..store import PayloadError, StoreUnavailable

        epoch, step, ranks, reason = given
        if reason == REJECTED:
            raise PayloadError(
                f"rank(s) {ranks} read a plan of epoch {epoch} step {step} from the plan store at "
                f"{store.address} that failed its check (HMAC signature, size or schema: forged, altered, or "
                "signed with another secret; that rank's log names the key); every rank stops at this step: give "
                "every rank and planner the same store.secret_env secret, and check what else writes to the store"
            )
        raise StoreUnavailable(
            f"the plan store at {store.address} did not answer for loader.plan_timeout_s = "
            f"{self.config.loader.plan_timeout_s:g} s (rank(s) {ranks} gave up at epoch {epoch} step {step}); every "
            "rank stops at this step: check the store is up and reachable from every rank, or raise "
            "loader.plan_timeout_s to ride out longer outages"
        )


def agreeing() -> bool:
    """Whether ranks have a process group to check their plans through (and to agree on giving up)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _as_int63(hex_digest: str) -> int:
    return int(hex_digest[:16], 16) >> 1  # a non-negative int64


def build_fingerprint() -> int:
    """This rank's planning code (``build``) as a non-negative int64, for the ranks to gather and compare."""
    return _as_int63(hashlib.sha256(build().encode()).hexdigest())


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
    ]
    return [_as_int63(hashlib.sha256(p).hexdigest()) for p in parts] + [build_fingerprint()]


def builds_differ() -> str:
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
