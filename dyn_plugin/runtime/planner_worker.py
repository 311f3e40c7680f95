"""One background planner process (started by planner_pool.PlannerPool)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

from ..child import die_with_parent

logger = logging.getLogger("dyn_plugin.planner_worker")

# While the store is unreachable, how long to pause between attempts (each is bounded by store.timeout_s).
RETRY_S = 0.1
# How often a planner checks that the store still holds its canary key: a server that restarted
# without its data dropped every plan published ahead, which the planner then publishes again.
LOSS_CHECK_S = 0.05


def first_position(worker: int, workers: int, at_least: int) -> int:
    """The first position at or after ``at_least`` that planner ``worker`` of ``workers`` plans: it
    plans the positions p with p % workers == worker, so every rank knows which planner owes a plan."""
    return at_least + (worker - at_least) % workers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    for name in ("--context", "--store", "--stop-key"):
        p.add_argument(name, required=True)
    for name in ("--worker", "--workers", "--prefetch", "--start", "--parent", "--world"):
        p.add_argument(name, type=int, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s planner[{args.worker}] %(levelname)s: %(message)s")
    die_with_parent(args.parent)
    # nothing to flush: plans not yet read are recomputed by whoever plans next
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    from ..config import StoreConfig
    from ..cost.online import Calibration
    from ..store import StoreUnavailable, open_store
    from ..store.payload import encode
    from .calibration import CALIBRATION_KEY
    from .planner_pool import CURSOR_KEY, canary_key, plan_key, progress_key
    from .planning import RANK_PLAN_SCHEMA, PlanningContext

    with open(args.context) as f:
        context = PlanningContext.from_json(f.read())
    with open(args.store) as f:
        cfg = StoreConfig.model_validate_json(f.read())
    # a client of the host rank's store (any rank but 0, which hosts it), on the host's node
    store = open_store(cfg, rank=1, world_size=max(args.world, 2))
    position = first_position(args.worker, args.workers, args.start)
    canary = canary_key(args.worker)
    store.put(canary, b"1")
    published, refreshed, checked = None, time.monotonic(), 0.0  # the last position published; when written, checked
    lost = False  # the store may have dropped what was published: publish again from the cursor on
    down = False
    calibrated = None  # the calibration versions last read from the store
    read_at = None  # the cursor they were read at: read again once it moves
    while True:
        if os.getppid() != args.parent:
            return 0
        try:
            if store.get(args.stop_key) is not None:
                return 0
            now = time.monotonic()
            if not lost and now - checked >= LOSS_CHECK_S:
                checked = now
                if store.get(canary) is None:
                    logger.warning("the store lost this planner's keys (restarted without its data?): publishing again")
                    lost = True
            # rewritten well within ttl_s, so they outlive every plan while this process lives
            if not lost and now - refreshed >= cfg.ttl_s / 4:
                store.put(canary, b"1")
                if published is not None:
                    store.put(progress_key(args.worker), str(published).encode())
                refreshed = now
            cursor = store.get(CURSOR_KEY)
            if cursor != read_at:
                # after the cursor, once it moved: the host publishes a version before it moves the
                # cursor past the position it was fitted at, so every position this loop may plan now
                # has its version here (a plan priced with an older one is made again on the ranks)
                versions = store.get(CALIBRATION_KEY)
                if versions is not None and versions != calibrated:
                    for version in json.loads(versions):
                        context.add_calibration(Calibration.from_dict(version))
                    calibrated = versions
                read_at = cursor
            if down:
                logger.warning("the store answers again")
                down = False
            if cursor is None:
                time.sleep(0.005)  # the host has not published where training is (yet, or again)
                continue
            at = int(cursor)
            # Lost: the plans from the cursor on are gone, publish them again. Behind the cursor (this
            # process was stopped, or slow): the ranks planned those steps themselves, skip them.
            if lost or position < at:
                position = first_position(args.worker, args.workers, at)
            if lost:
                store.put(canary, b"1")
                lost = False
            if position >= at + args.prefetch:
                time.sleep(0.005)  # far enough ahead: let training catch up
                continue
            for (dp_rank, pp_rank), rank_plan in context.plan(*context.locate(position)).items():
                payload = encode(rank_plan.to_meta(), {}, schema=RANK_PLAN_SCHEMA)
                for replica in range(context.tp):  # the cell's tensor-parallel ranks each read their own copy
                    store.put(plan_key(position, dp_rank, pp_rank, replica), payload)
            store.put(progress_key(args.worker), str(position).encode())
            published = position
            position += args.workers
        except StoreUnavailable as exc:
            # The ranks plan without us while the store is down; exiting would only make the host
            # report a planner failure once it is back. A restart may have wiped it: publish again.
            if not down:
                logger.warning("%s; retrying until it answers", exc)
            down = lost = True
            time.sleep(RETRY_S)


if __name__ == "__main__":
    sys.exit(main())
