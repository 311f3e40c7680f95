"""One rank of the kill-and-resume test: train an epoch with DeepSpeed (ZeRO-1, AdamW), or
stop after K steps with a checkpoint and die, or resume from it (run as a script)."""

import json
import os
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist

import deepspeed_ext

deepspeed_ext.skip_cpu_shm_build()

import deepspeed  # noqa: E402

from ds_exact_worker import MODEL  # noqa: E402
from dyn_plugin.models.hf import build_causal_lm  # noqa: E402


def main():
    out, mode = sys.argv[1], sys.argv[2]  # full | stop-after:K | resume
    deepspeed.init_distributed(dist_backend="gloo")
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 200, size=40)
    data = [{"input_ids": rng.integers(0, 97, size=int(n))} for n in lengths]
    torch.manual_seed(0)
    model = build_causal_lm(MODEL)
    config = {
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "dyn_plugin": {
            "microbatching": {"global_tokens": 1500, "max_seq_len": 256},
            "cost_model": {"kind": "analytic", "dtype": "fp32"},
        },
    }
    engine, _, loader, _ = deepspeed_ext.initialize(
        model=model,
        config=config,
        dataset=data,
        lengths=lengths,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        seed=5,
    )
    ckpt = os.path.join(out, "ckpt")
    if mode == "resume":
        deepspeed_ext.load_checkpoint(engine, loader, ckpt)
    stop = int(mode.split(":")[1]) if mode.startswith("stop-after") else None
    for n, step in enumerate(loader):
        deepspeed_ext.train_step(engine, step)
        if stop is not None and n + 1 == stop:
            deepspeed_ext.save_checkpoint(engine, loader, ckpt, tag="crash")
            os.kill(os.getpid(), signal.SIGKILL)
    if dist.get_rank() == 0:
        flat = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
        torch.save(flat, os.path.join(out, f"params-{mode}.pt"))
        with open(os.path.join(out, f"done-{mode}.json"), "w") as f:
            json.dump({"epoch": loader.epoch}, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
