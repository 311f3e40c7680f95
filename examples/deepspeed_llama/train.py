"""Train a tiny Llama with DeepSpeed on the plugin's micro-batches (CPU ranks, or one GPU each).

    torchrun --nproc_per_node=2 examples/deepspeed_llama/train.py --steps 20

Your model, your data, and the plugin's lines: ``deepspeed_ext.initialize`` (DeepSpeed's initialize
plus the plugin's loader), ``deepspeed_ext.train_step`` per planned step and, optionally,
``deepspeed_ext.save_checkpoint`` (the loader's position beside DeepSpeed's checkpoint). To see
the plugin's plans against padding, token budgets and packing side by side: ``dynplugin bench train``.
"""

import argparse
import os

import torch
import torch.distributed as dist

import deepspeed_ext
from dyn_plugin.bench.train_common import tokenized_corpus
from dyn_plugin.models.hf import build_causal_lm, load_model_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", help="a profile of this machine (dynplugin profile); default: analytic costs")
    p.add_argument("--data", default="out/example-data", help="folder where rank 0 caches the token ids")
    p.add_argument("--save", help="checkpoint folder (the engine and the loader's position), after the last step")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # from the deepspeed launcher
    args = p.parse_args()
    deepspeed_ext.skip_cpu_shm_build()  # on CPU, gloo does the collectives: no shared-memory op to compile
    import deepspeed

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")

    # your model: a tiny Llama built from its config (random weights)
    torch.manual_seed(0)
    model = build_causal_lm(load_model_config("tiny-llama"))
    # your data: token ids of real code (the Python standard library through the plugin's offline BPE)
    os.makedirs(args.data, exist_ok=True)
    docs, lengths = tokenized_corpus("code", 4096, args.data)
    dataset = [{"input_ids": ids} for ids in docs]

    config = {
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "dyn_plugin": {
            "cost_model": {"kind": "profile", "profile": args.profile, "dtype": "fp32"}
            if args.profile
            else {"kind": "analytic", "dtype": "fp32"},
            "microbatching": {"global_tokens": 16384, "max_seq_len": 4096},
            "cluster": {"devices_per_node": dist.get_world_size(), "device": {"memory_mb": 8000}},
        },
    }
    # the plugin: DeepSpeed's engine, and a loader whose every step is a planned global batch
    engine, _, loader, _ = deepspeed_ext.initialize(
        model=model,
        config=config,
        dataset=dataset,
        lengths=lengths,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
    )
    for n, step in enumerate(loader):
        loss = deepspeed_ext.train_step(engine, step)  # token-mean loss of the whole global batch
        if dist.get_rank() == 0:
            print(f"step {n}: {len(step.micro_batches)} micro-batches on rank 0, loss {loss:.3f}", flush=True)
        if n + 1 == args.steps:
            break
    if args.save:
        deepspeed_ext.save_checkpoint(engine, loader, args.save)  # deepspeed_ext.load_checkpoint resumes
    dist.destroy_process_group()
    os._exit(0)  # DeepSpeed sometimes aborts in its exit handlers on CPU


if __name__ == "__main__":
    main()
