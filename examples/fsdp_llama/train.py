"""Train a tiny Llama with plain PyTorch FSDP2 under a sharding plan the plugin searches (OSDP).

    torchrun --nproc_per_node=2 examples/fsdp_llama/train.py --budget-mb 700 --steps 3

Your model, your data, and the plugin's lines: ``fsdp.initialize`` searches a sharding choice per
module for the memory budget (model states + activations per rank), wraps the model with
``fully_shard`` as the plan says and returns the plugin's loader, which cuts each global batch
into micro-batches for the memory the plan leaves; ``fsdp.train_step`` runs one planned step (the
update is the exact token mean of its global batch) and, optionally, ``fsdp.save_checkpoint`` writes
the sharded model and optimizer (torch.distributed.checkpoint) beside the loader's position. To
train every sharding method side by side under one budget: ``dynplugin bench shard --train``.
"""

import argparse
import os

import torch
import torch.distributed as dist

from dyn_plugin import fsdp
from dyn_plugin.bench.train_common import tokenized_corpus
from dyn_plugin.models.hf import build_causal_lm, load_model_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-mb", type=float, default=700, help="memory per rank the plan may use")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--profile", help="a profile of this machine (dynplugin profile --ranks 2); default: analytic costs")
    p.add_argument("--data", default="out/example-data", help="folder where rank 0 caches the token ids")
    p.add_argument("--fsdp", choices=("fsdp2", "fsdp1"), default="fsdp2")
    p.add_argument(
        "--save", help="checkpoint folder (the sharded model and optimizer, the loader's position), after the last step"
    )
    args = p.parse_args()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")

    # your model: a tiny Llama built from its config (random weights)
    torch.manual_seed(0)
    model = build_causal_lm(load_model_config("tiny-llama"))
    # your data: token ids of real code (the Python standard library through the plugin's offline BPE)
    os.makedirs(args.data, exist_ok=True)
    docs, lengths = tokenized_corpus("code", 4096, args.data)
    dataset = [{"input_ids": ids} for ids in docs]

    config = {
        "dyn_plugin": {
            "cost_model": {"kind": "profile", "profile": args.profile, "dtype": "fp32"}
            if args.profile
            else {"kind": "analytic", "dtype": "fp32"},
            "microbatching": {"global_tokens": 16384, "max_seq_len": 4096},
            "sharding": {"enabled": True, "memory_budget_mb": args.budget_mb},
            "cluster": {"devices_per_node": dist.get_world_size(), "device": {"memory_mb": args.budget_mb}},
        }
    }
    # the plugin: the model wrapped as the plan says, and a loader whose every step is a planned global batch
    model, optimizer, loader, _ = fsdp.initialize(
        model, config, dataset, lengths, fsdp=args.fsdp, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3)
    )
    plan = fsdp.shard_plan_of(model)
    if dist.get_rank() == 0:
        kinds = sorted({u.choice.label for u in plan.units})
        print(f"plan: {', '.join(kinds)}; predicted peak {plan.peak_bytes / 2**20:.0f} of {args.budget_mb:.0f} MB")
    for n, step in enumerate(loader):
        loss = fsdp.train_step(model, optimizer, step)  # token-mean loss of the whole global batch
        if dist.get_rank() == 0:
            print(f"step {n}: {len(step.micro_batches)} micro-batches on rank 0, loss {loss:.3f}", flush=True)
        if n + 1 == args.steps:
            break
    if args.save:
        fsdp.save_checkpoint(model, optimizer, loader, args.save)  # fsdp.load_checkpoint resumes
    loader.close()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
