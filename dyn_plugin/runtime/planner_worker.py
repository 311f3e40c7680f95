"""One background planner process (started by planner_pool.PlannerPool)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from ..child import die_with_parent

logger = logging.getLogger("dyn_plugin.planner_worker")


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
    from ..store import open_store
    from ..store.payload import encode
    from .planner_pool import CURSOR_KEY, plan_key, progress_key
    from .planning import RANK_PLAN_SCHEMA, PlanningContext

    with open(args.context) as f:
        context = PlanningContext.from_json(f.read())
    with open(args.store) as f:
        cfg = StoreConfig.model_validate_json(f.read())
    # a client of the host rank's store (any rank but 0, which hosts it), on the host's node
    store = open_store(cfg, rank=1, world_size=max(args.world, 2))
    position = args.start + args.worker
    published, refreshed = None, 0.0  # the last position published, and when its progress key was written
    while True:
        if os.getppid() != args.parent or store.get(args.stop_key) is not None:
            return 0
        # rewritten well within ttl_s, so progress outlives every plan while this process lives
        if published is not None and time.monotonic() - refreshed >= cfg.ttl_s / 4:
            store.put(progress_key(args.worker), str(published).encode())
            refreshed = time.monotonic()
        cursor = store.get(CURSOR_KEY)
        if cursor is None or position >= int(cursor) + args.prefetch:
            time.sleep(0.005)  # far enough ahead: let training catch up
            continue
        for (dp_rank, pp_rank), rank_plan in context.plan(*context.locate(position)).items():
            payload = encode(rank_plan.to_meta(), {}, schema=RANK_PLAN_SCHEMA)
            for replica in range(context.tp):  # the cell's tensor-parallel ranks each read their own copy
                store.put(plan_key(position, dp_rank, pp_rank, replica), payload)
        published, refreshed = position, float("-inf")  # its progress is written at once
        position += args.workers


if __name__ == "__main__":
    sys.exit(main())
