"""One rank of the online-calibration test (run as a script: ``calibration_worker.py OUT``; env
``TEST_STORE``: the store section, default none). The machine is 2x slower than the profile on
every term and 3x on attention, with noise that differs per rank, and its activations take 1.2x
(rank 0) and 1.3x (rank 1) the memory the profile says: each step's timings are the profile's prediction
of each micro-batch distorted so, handed to the step's ``observe`` as a host's token-mean step
does. Writes per step the plan's digest, the digest this rank's own planning context gives the
same step (the planner processes' plans must be the ones the ranks would make with the versions
they hold), the calibration version and the step's predicted ms to OUT/rank{r}.jsonl."""

import json
import os
import sys

import numpy as np
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from dyn_plugin.cost.model import features  # noqa: E402
from dyn_plugin.layout import RankLayout  # noqa: E402
from dyn_plugin.runtime.loader import DynLoader  # noqa: E402
from test_loader import make  # noqa: E402

STEPS = 24


def distorted(loader, step, rng) -> list:
    """(forward ms, backward ms) per micro-batch: the profile's, token terms x2, attention x3, +-3%."""
    spec = loader.context.spec
    out = []
    for desc in step.loaded:
        t = spec.cost.table(desc.layout, desc.recompute, 1)
        f = features(desc.seq_lens, desc.layout, spec.cost.pad_multiple)
        stage = spec.stages[0]
        times = []
        for metric in ("forward_ms", "backward_ms"):
            token = pair = 0.0
            for comp, k in (("embedding", int(stage.first)), ("layer", stage.num_layers), ("head", int(stage.last))):
                c0, c1, c2 = t.fits[comp][metric].coef
                token += k * (c0 + c1 * f.slots)
                pair += k * c2 * f.attn
            times.append((2.0 * token + 3.0 * pair) * rng.uniform(0.97, 1.03))
        out.append(tuple(times))
    return out


def true_peak(loader, step, activations: float) -> float:
    """The step's peak bytes on a device whose activations are ``activations`` x the profile's."""
    states = loader.context.spec.memory[0].states
    planned = loader.context.calibration_at(loader.context.position(step.epoch, step.index)).memory
    return states + activations * (step.predicted_peak_mb * 2**20 - states) / planned


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = sys.argv[1]
    store = json.loads(os.environ.get("TEST_STORE", '{"backend": "none"}'))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg, cm, lens, data = make(
        n=400,
        store=store,
        loader={"planners": 1, "prefetch": 2, "plan_timeout_s": 30},
        calibration={"warmup_steps": 1, "every": 2, "min_observations": 8},
    )
    loader = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(world), column=rank, seed=5)
    rng = np.random.default_rng(rank)  # every rank measures its own noise: the gather makes them agree
    done = 0
    with open(os.path.join(out, f"rank{rank}.jsonl"), "w") as log:
        while done < STEPS:
            for step in loader:
                local = loader.context.plan(step.epoch, step.index)[(rank, 0)]
                version = loader.context.calibration_at(loader.context.position(step.epoch, step.index)).version
                record = {"digest": step.digest, "local": local.digest, "version": version, "ms": step.predicted_ms}
                log.write(json.dumps(record) + "\n")
                step.observe(distorted(loader, step, rng), true_peak(loader, step, 1.2 + 0.1 * rank))
                done += 1
                if done == STEPS:
                    break
        last = loader.calibration.calibrator.calibration
        log.write(
            json.dumps({"factors": last.factors, "memory": last.memory, "errors": loader.calibration.errors}) + "\n"
        )
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
