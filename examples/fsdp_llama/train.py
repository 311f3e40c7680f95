"""A Llama trained with plain PyTorch FSDP2 under a sharding plan the plugin searches (OSDP).

    torchrun --nproc_per_node=2 examples/fsdp_llama/train.py --budget-mb 700 --steps 3

Rank 0 searches a sharding choice per module for the budget (model states + activations per
rank) and shares it; every rank wraps the model with ``fully_shard`` as the plan says, and the
plugin's loader cuts each global batch of real code into micro-batches for the memory the plan
leaves. Each step's update is the exact token mean of its global batch.
"""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist

from dyn_plugin import fsdp
from dyn_plugin.models.hf import build_causal_lm, load_model_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--budget-mb", type=float, default=700, help="memory per rank the plan may use")
    p.add_argument("--profile", help="a profile of this machine (dynplugin profile --ranks 2); default: analytic costs")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fsdp", choices=("fsdp2", "fsdp1"), default="fsdp2")
    args = p.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rng = np.random.default_rng(0)  # stand-in data: swap in your dataset and its lengths
    lengths = np.minimum(rng.lognormal(6, 1.2, size=400).astype(int) + 2, 4096)
    dataset = [{"input_ids": rng.integers(0, 8192, size=int(n))} for n in lengths]
    config = {"dyn_plugin": {
        "cost_model": {"kind": "profile", "profile": args.profile, "dtype": "fp32"} if args.profile
        else {"kind": "analytic", "dtype": "fp32"},
        "microbatching": {"global_tokens": 16384, "max_seq_len": 4096},
        "sharding": {"enabled": True, "memory_budget_mb": args.budget_mb},
        "cluster": {"devices_per_node": dist.get_world_size(), "device": {"memory_mb": args.budget_mb}},
    }}
    torch.manual_seed(0)
    model = build_causal_lm(load_model_config(args.model))
    model, optimizer, loader, plan = fsdp.initialize(
        model, config, dataset, lengths, fsdp=args.fsdp, optimizer_fn=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    if dist.get_rank() == 0:
        kinds = sorted({u.choice.label for u in plan.units})
        print(f"plan: {', '.join(kinds)}; predicted peak {plan.peak_bytes / 2**20:.0f} of {args.budget_mb:.0f} MB")
    for n, step in enumerate(loader):
        loss = fsdp.train_step(model, optimizer, step, plan)
        if dist.get_rank() == 0:
            print(f"step {n}: {len(step.micro_batches)} micro-batches on rank 0, loss {loss:.3f}")
        if n + 1 == args.steps:
            break
    loader.close()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
