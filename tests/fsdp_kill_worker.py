"""One rank of the FSDP checkpoint tests (run as a script: OUT PATH, PATH fsdp2 or fsdp1): train one
epoch of a tiny Llama under a hand-made sharding plan with AdamW and a decaying learning rate, checkpointing
after every step with ``dyn_plugin.fsdp.save_checkpoint``, resumed from the newest whole checkpoint
at each launch and killed where ``KILL`` says (tests/kill_harness.py).

The checkpoint's client state carries the consumed log (each step's position and every sample it
trained, gathered from every rank), so a resumed launch holds the history of the steps its
checkpoint holds and nothing of the lost ones. At the end rank 0 writes the log, the full
parameters and the checkpoint this launch resumed from to ``final.pt``.
"""

import os
import sys

import torch
import torch.distributed as dist

from dyn_plugin import fsdp
from dyn_plugin.models.hf import build_causal_lm
from fsdp_worker import config, full_params, hand_plan
from kill_harness import KillSwitch
from token_mean import MODEL, random_dataset

# every kind of choice the path runs, a split head among them (its slices name parameters)
PLANS = {
    "fsdp2": ["keep", "replicate", "grad_op", "full", "keep", "split(1/2)", "full"],
    "fsdp1": ["replicate", "grad_op", "full", "keep", "full", "split(1/2)", "full"],
}
GLOBAL_TOKENS = 700  # the 40 samples' ~4,000 tokens: six steps
ACTIVATIONS_MB = 1.2  # beside the plan's model states: each step cut into two or three micro-batches per rank


def planned_run(path: str, world: int, **initialize) -> tuple:
    """(model, optimizer, loader, scheduler) of the run the kill and checkpoint-fault tests train: the
    tiny Llama under the hand-made plan of ``path`` (FSDP1 or FSDP2), steps of ``GLOBAL_TOKENS``;
    ``initialize``: more of ``fsdp.initialize``'s keywords."""
    lengths, data = random_dataset(0)
    torch.manual_seed(0)
    model = build_causal_lm(MODEL)
    plan = hand_plan(model, world, world, PLANS[path], path)
    cfg = config("none", "packed", plan)
    cfg["dyn_plugin"]["microbatching"]["global_tokens"] = GLOBAL_TOKENS
    # global batches of consecutive samples (no lookahead): fuller ones do not fit the device sized below
    cfg["dyn_plugin"]["microbatching"]["lookahead"] = 0
    cfg["dyn_plugin"]["calibration"] = {"enabled": False}  # bit for bit across kills: plans from the profile alone
    cfg["dyn_plugin"]["cluster"]["device"]["memory_mb"] = plan.state_bytes / 2**20 + ACTIVATIONS_MB
    return fsdp.initialize(
        model,
        cfg,
        data,
        lengths,
        shard_plan=plan,
        fsdp=path,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        seed=3,
        **initialize,
    )


def main() -> None:
    out, path = sys.argv[1], sys.argv[2]
    switch = KillSwitch(int(os.environ["RANK"]))
    switch.arm_saves()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    # the learning rate follows the scheduler's step count: a resume that lost it trains differently
    model, optimizer, loader, _ = planned_run(
        path,
        world,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 0.7**n),
    )
    switch.arm_model(model)
    ckpt = os.path.join(out, "ckpt")
    consumed: list = []
    resumed = None
    try:
        resumed, client = fsdp.load_checkpoint(model, optimizer, loader, ckpt)  # and the scheduler initialize built
        consumed = client["consumed"]
    except FileNotFoundError:
        pass  # the first launch
    switch.hit("startup")
    for step in loader:
        fsdp.train_step(model, optimizer, step)  # steps the scheduler too
        every = [None] * world
        dist.all_gather_object(every, [i for mb in step.sample_ids for i in mb])
        consumed.append([loader.position - 1, sorted(i for ids in every for i in ids)])
        with switch.saving():
            fsdp.save_checkpoint(model, optimizer, loader, ckpt, client_state={"consumed": consumed})
    params = full_params(model, path)
    if dist.get_rank() == 0:
        torch.save({"params": params, "consumed": consumed, "resumed": resumed}, os.path.join(out, "final.pt"))
    dist.barrier()
    loader.close()
    dist.destroy_process_group()
    os._exit(0)  # torch's native teardown takes seconds on CPU (and once aborted): nothing is left to run


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
