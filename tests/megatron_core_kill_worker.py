"""One rank of the megatron-core kill test (tests/test_megatron_kills.py), run through the plugin's
launcher (``dynplugin megatron --dyn-plugin-config CFG --nproc-per-node 2 -- THIS ARGS``).

The loop is the example's (``examples/megatron_gpt/train.py``: its GPT, Megatron's dataset builder
over its ``--data`` folder, its forward step, Megatron's optimizer, DDP and learning-rate schedule,
all imported from it), with what a run that can be killed needs and the example leaves out: a
checkpoint after every step, each in a folder of its own (``--save``/step-N), and a resume from
the latest whole one (``dyn_plugin.host.checkpoint.agreed_newest``). A checkpoint folder holds the
optimizer's state and the loop's counters and Megatron's distributed checkpoint of the model, all
written inside one ``checkpoint.saving`` (the marker last, with the loader's position and every
file's hash); the plugin's patch of ``dist_checkpointing.load`` restores that position.

The kill switch (``kill_harness.KillSwitch``, point in ``$KILL``) is armed on the model and the
saves; each step is logged as it is trained (``megatron_kill_rank``) and the last launch writes
the final parameters.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

# Megatron's checkpoint writer starts a queue server by multiprocessing's spawn, which runs this
# file first (as __mp_main__): everything else is imported in the functions, not in that process.

EXAMPLE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "megatron_gpt", "train.py"
)


def example():
    """The example's module (its ``main`` is not run: it saves once, after the last step)."""
    spec = importlib.util.spec_from_file_location("megatron_gpt_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--save", required=True, help="checkpoints: one folder per step")
    p.add_argument("--out", required=True, help="the consumed log and the final parameters")
    p.add_argument("--steps", type=int, required=True, help="the loader's global batches in one epoch")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recompute", action="store_true")
    return p.parse_args()


def save(switch, folder: str, model, optimizer, iteration: int, scheduler_steps: int) -> None:
    """The loop's own files, then Megatron's checkpoint, all inside one ``checkpoint.saving``: the
    folder is cleared (a killed launch's marker first) before anything is written, and the marker,
    written last, makes it whole (the patched ``dist_checkpointing.save`` joins the save under way)."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from dyn_plugin.host import checkpoint
    from megatron_patches import runtime

    record = checkpoint.Record.of(runtime.RUN.loader)
    with switch.saving(), checkpoint.saving(os.path.dirname(folder), os.path.basename(folder), record):
        torch.save(optimizer.state_dict(), os.path.join(folder, f"optim-{dist.get_rank()}.pt"))
        if dist.get_rank() == 0:
            with open(os.path.join(folder, "train_state.json"), "w") as f:
                json.dump({"iteration": iteration, "scheduler_steps": scheduler_steps}, f)
        dist_checkpointing.save(model.module.sharded_state_dict(), folder)


def main() -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from dyn_plugin.host import checkpoint
    from kill_harness import KillSwitch
    from megatron_kill_rank import log_step, resume_log, write_final
    from megatron_patches import runtime

    args = arguments()
    rank = int(os.environ["RANK"])
    switch = KillSwitch(rank)
    switch.arm_saves()
    ex = example()
    device = ex.initialize(1, 1, args.seed)
    torch.manual_seed(args.seed)
    model = ex.model_provider(args).to(device)
    config = model.config
    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=False),
        [model],
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr,
        max_lr=args.lr,
        min_lr=0.0,
        lr_warmup_steps=0,
        lr_decay_steps=10**9,
        lr_decay_style="constant",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    train = ex.datasets(args)
    start = 0
    resumed = checkpoint.agreed_newest(args.save)
    if resumed is not None:
        state = dist_checkpointing.load(model.module.sharded_state_dict(), resumed.path)
        model.module.load_state_dict(state)
        with open(os.path.join(resumed.path, "train_state.json")) as f:
            saved = json.load(f)
        start, scheduler.num_steps = saved["iteration"], saved["scheduler_steps"]
        optimizer.load_state_dict(torch.load(os.path.join(resumed.path, f"optim-{rank}.pt")))
    resume_log(args.out, rank, start)
    switch.arm_model(model)
    switch.hit("startup")
    iterator = iter(torch.utils.data.DataLoader(train, batch_size=1, shuffle=False))
    forward_backward = get_forward_backward_func()
    for it in range(start, args.steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(
            forward_step_func=ex.forward_step,
            data_iterator=iterator,
            model=model,
            num_microbatches=args.micro_batches,
            seq_length=args.seq_length,
            micro_batch_size=1,
            forward_only=False,
        )
        optimizer.step()
        scheduler.step(increment=args.micro_batches * dist.get_world_size())
        log_step(args.out, rank, it, runtime.RUN)
        save(switch, os.path.join(args.save, f"step-{it + 1}"), model, optimizer, it + 1, scheduler.num_steps)
    write_final(args.out, rank, model, runtime.RUN)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
