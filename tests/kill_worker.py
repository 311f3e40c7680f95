"""One rank of the random-kill tests: train a tiny float64 model on the loader's steps, checkpoint
after every step, and SIGKILL itself where KILL_AT says; a later launch resumes from the
checkpoint (run as a script; env rendezvous, gloo).

KILL_AT: "none", "startup" (loader built and, on the host, its planners started: no step yet),
"K:before-save" (after training the K-th step of this launch, before its checkpoint: that step is
redone) or "K:after-save". EPOCHS: epochs to train. TEST_STORE: the store section, as JSON.
"""

import json
import os
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from dyn_plugin.layout import RankLayout  # noqa: E402
from dyn_plugin.runtime.loader import DynLoader  # noqa: E402
from test_loader import make  # noqa: E402

DIM = 8
SEED = 11


def setup(store: dict) -> tuple:
    return make(store=store, loader={"planners": 1, "prefetch": 2, "plan_timeout_s": 60})


def local_gradient(params: torch.Tensor, step, lengths: np.ndarray) -> torch.Tensor:
    """This rank's share of the gradient: depends on the parameters, so the order of steps counts."""
    grad = torch.zeros(DIM, dtype=torch.float64)
    for i in (i for mb in step.sample_ids for i in mb):
        grad += torch.sin(params * (i % 7 + 1) + i) * float(lengths[i])
    return grad


def update(params: torch.Tensor, grad: torch.Tensor, step) -> torch.Tensor:
    return params - 0.1 * grad / step.scored_tokens


def initial_params() -> torch.Tensor:
    return torch.linspace(-1, 1, DIM, dtype=torch.float64)


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = sys.argv[1]
    kill, epochs = os.environ.get("KILL_AT", "none"), int(os.environ.get("EPOCHS", "1"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    store = json.loads(os.environ["TEST_STORE"])
    cfg, cm, lens, data = setup(store)
    loader = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(world), column=rank, seed=SEED)
    ckpt = os.path.join(out, f"ckpt{rank}.json")
    params, consumed = initial_params(), []
    if os.path.exists(ckpt):
        with open(ckpt) as f:
            state = json.load(f)
        loader.load_state_dict(state["loader"])
        params, consumed = torch.tensor(state["params"], dtype=torch.float64), state["consumed"]

    def die() -> None:
        dist.barrier()  # every rank at the same point, then all die as a crash would take them
        os.kill(os.getpid(), signal.SIGKILL)

    if kill == "startup":
        if loader._store is not None and loader.is_host:
            loader._source.start_planners(loader.position)
        die()
    at, phase = (int(kill.split(":")[0]), kill.split(":")[1]) if ":" in kill else (None, None)
    n = 0
    while loader.epoch < epochs:
        for step in loader:
            grad = local_gradient(params, step, lens)
            dist.all_reduce(grad)
            params = update(params, grad, step)
            n += 1
            if n == at and phase == "before-save":
                die()
            consumed.append([i for mb in step.sample_ids for i in mb])
            tmp = ckpt + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"params": params.tolist(), "loader": loader.state_dict(), "consumed": consumed}, f)
            os.replace(tmp, ckpt)
            if n == at:
                die()
    with open(os.path.join(out, f"final{rank}.json"), "w") as f:
        json.dump({"params": params.tolist(), "consumed": consumed}, f)
    dist.barrier()
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
