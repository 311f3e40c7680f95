"""One rank of the store fault tests: kill_worker.py's tiny float64 training (no checkpoints), with a
fault the host rank causes itself at a step, or one the test causes from outside while it trains
(run as a script; env rendezvous, gloo).

FAULT: "none", "sigstop" or "sigkill" (the host stops or kills its planner process after training
step FAULT_AT). TEST_STORE: the store section, TEST_LOADER: the loader section, as JSON. EPOCHS:
epochs to train; STEP_S: a pause after each step, so faults from outside land mid-run. Rank 0
writes the steps it trained to OUT/steps (the test's clock for faults from outside); each rank
writes OUT/final{rank}.json at the end.
"""

import json
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from dyn_plugin.atomic import write_atomic  # noqa: E402
from dyn_plugin.layout import RankLayout  # noqa: E402
from dyn_plugin.runtime.loader import DynLoader  # noqa: E402
from kill_worker import SEED, initial_params, local_gradient, update  # noqa: E402
from test_loader import make  # noqa: E402


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = sys.argv[1]
    logging.basicConfig(level=logging.WARNING, format=f"rank{rank} %(levelname)s %(name)s: %(message)s")
    fault, at = os.environ.get("FAULT", "none"), int(os.environ.get("FAULT_AT", "0"))
    epochs, pause = int(os.environ.get("EPOCHS", "1")), float(os.environ.get("STEP_S", "0"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg, cm, lens, data = make(store=json.loads(os.environ["TEST_STORE"]), loader=json.loads(os.environ["TEST_LOADER"]))
    loader = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(world), column=rank, seed=SEED)
    params, consumed, n = initial_params(), [], 0
    while loader.epoch < epochs:
        for step in loader:
            grad = local_gradient(params, step, lens)
            dist.all_reduce(grad)
            params = update(params, grad, step)
            consumed.append([i for mb in step.sample_ids for i in mb])
            n += 1
            if rank == 0:  # whole or absent: the test polls it (a truncated file read as '' failed it once)
                write_atomic(os.path.join(out, "steps"), str(n))
            if n == at and fault in ("sigstop", "sigkill") and loader.is_host:
                pid = loader._pool.procs[0].pid
                write_atomic(os.path.join(out, "planner.pid"), str(pid))
                os.kill(pid, signal.SIGSTOP if fault == "sigstop" else signal.SIGKILL)
            time.sleep(pause)
    with open(os.path.join(out, f"final{rank}.json"), "w") as f:
        json.dump({"params": params.tolist(), "consumed": consumed, "plan_wait_s": loader.plan_wait_s}, f)
    dist.barrier()
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
