"""Train a megatron-core GPT three ways side by side on real code: Megatron's batchings against the plugin's.

    python -m torch.distributed.run --nproc_per_node=2 -m dyn_plugin.bench.train_megatron \\
        --profile out/profile.json --out out/train-megatron

The Megatron counterpart of train_deepspeed.py (``dynplugin bench train --host megatron``
launches it, and with ``--json`` prints the summary as JSON): the same corpus (the Python standard library's
source, tokenized with the plugin's offline BPE), the same cost model and the same rows, so the
two hosts' figures compare. The model is examples/megatron_gpt/train.py's GPT (its model provider,
forward step and loss function) in the tiny-llama shape that ``dynplugin profile --model
tiny-llama`` measures, wrapped in Megatron's DDP and optimizer (Adam) as the example does, and
trained through Megatron's own ``get_forward_backward_func`` under the plugin's patches, on gloo
CPU ranks (tp=1, pp=1, fp32).

Modes (only the plugin's ``microbatching.method`` differs): padded (every sequence padded to the
maximum length: Megatron's default), packing (fixed-length rows of the maximum length, documents
attending across each other: Megatron's packing) and dyn_plugin (the plugin's plan). Each mode
trains a fresh model from the same seed on the same global batches. Rank 0 writes records.jsonl,
summary.json, report.md and report.png.

The one module of ``dyn_plugin`` that imports the Megatron adapter (``megatron_patches``) and
megatron-core: it runs only as the ranks' main module, launched by name in child processes (never
imported by the CLI or the core), so ``dyn_plugin`` itself still runs without Megatron installed
(tests/test_layers.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import runpy
import time
from argparse import Namespace

import torch
import torch.distributed as dist
from tqdm import tqdm

import megatron_patches

from .train_common import (
    batchings_preamble,
    common_parser,
    cost_model_section,
    finish_batchings,
    step_record,
    tokenized_corpus,
)

# mode -> the plugin's microbatching.method
MODES = {"padded": "fixed_padding", "packing": "packing_full", "dyn_plugin": "dynapipe"}
BASELINES = ("padded", "packing")  # the ratios the report shows
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "megatron_gpt", "train.py")
# the tiny-llama preset (dyn_plugin.models.hf.PRESETS) as the example's model provider reads it
TINY_LLAMA = dict(layers=4, hidden=128, heads=4, kv_heads=2, ffn=512, vocab=8192, recompute=False)


def load_example() -> dict:
    """examples/megatron_gpt/train.py's globals (model_provider, forward_step, initialize)."""
    if not os.path.exists(EXAMPLE):
        raise SystemExit(f"{EXAMPLE} not found: the comparison trains the example's GPT; run it from a source checkout")
    return runpy.run_path(EXAMPLE)


def plugin_config(mode: str, args: argparse.Namespace) -> dict:
    """The run's config: the same sections as train_deepspeed.run_mode builds (fp32 on CPU)."""
    return {
        "dyn_plugin": {
            "cost_model": cost_model_section(args.profile, "fp32"),
            "microbatching": {"global_tokens": args.global_tokens, "max_seq_len": args.max_len, "method": MODES[mode]},
            "cluster": {"devices_per_node": dist.get_world_size(), "device": {"memory_mb": args.memory_mb}},
        }
    }


def run_mode(mode: str, args: argparse.Namespace, ex: dict, docs: list, lengths, device: torch.device) -> list[dict]:
    """Train a fresh model ``args.warmup + args.steps`` steps under ``mode``'s plans; one record per timed step."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_patches import runtime

    run = runtime.configure(plugin_config(mode, args), seed=args.seed)
    run.set_documents(runtime.Documents(docs, lengths))
    waits: list[float] = []
    next_step = run.next_step

    def timed_next_step(model):  # how long the training call waited for its plan (inside the measured step)
        t0 = time.perf_counter()
        step = next_step(model)
        waits.append((time.perf_counter() - t0) * 1e3)
        return step

    run.next_step = timed_next_step
    torch.manual_seed(args.seed)
    model = ex["model_provider"](Namespace(**TINY_LLAMA, seq_length=args.max_len)).to(device)
    config = model.config
    model = DistributedDataParallel(
        config=config,
        module=model,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        ),
    )
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=False),
        [model],
    )
    forward_backward = get_forward_backward_func()
    records = []
    total = args.warmup + args.steps
    bar = tqdm(total=total, desc=f"{mode:>12}", disable=dist.get_rank() != 0)
    for n in range(total):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        dist.barrier()
        t0 = time.perf_counter()
        # the micro-batch count and shapes are the plan's: the patched schedule ignores these
        losses = forward_backward(
            forward_step_func=ex["forward_step"],
            data_iterator=iter([]),
            model=model,
            num_microbatches=1,
            seq_length=args.max_len,
            micro_batch_size=1,
            forward_only=False,
        )
        optimizer.step()
        dist.barrier()
        ms = (time.perf_counter() - t0) * 1e3
        step = run.step
        # every rank of a sequence-parallel group would list the group's samples: count them on its first shard only
        real = sum(
            sum(len(docs[i]) for i in mb) for mb, (_, _, index) in zip(step.sample_ids, step.shards) if index == 0
        )
        slots = sum(int(m["input_ids"].numel()) for m in step.micro_batches)
        sums = torch.tensor([real, slots, 0.0, 0.0], dtype=torch.float64)
        for report in losses:  # (summed loss, scored tokens) of each micro-batch
            sums[2:] += report["lm loss"].detach().double().cpu()
        dist.all_reduce(sums)
        bar.update()
        if n >= args.warmup:
            total_real, total_slots, loss = float(sums[0]), float(sums[1]), float(sums[2] / sums[3])
            records.append(step_record(mode, n, step, ms, total_real, total_slots, loss, plan_wait_ms=waits[-1]))
    bar.close()
    del model, optimizer
    gc.collect()
    return records


def preamble(args: argparse.Namespace) -> str:
    return batchings_preamble(
        f"# Training demo: megatron-core GPT (tiny-llama shape), Megatron DDP + Adam, {dist.get_world_size()} "
        "CPU ranks (gloo, fp32)",
        args,
        "padded: every sequence padded to the maximum length (Megatron's default); packing: rows of the maximum "
        "length, documents attending across each other (Megatron's packing; hence its slightly different loss).",
        how=", each through Megatron's get_forward_backward_func under the plugin's patches",
    )


def main() -> None:
    p = common_parser(
        __doc__,
        "out/train-megatron",
        "tiny-llama profile of this machine (dynplugin profile); without it the analytic cost model prices the plans",
    )
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--memory-mb", type=float, default=8000, help="device memory the plans may fill")
    args = p.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    megatron_patches.apply()  # once: each mode configures its own run
    ex = load_example()
    device = ex["initialize"](1, 1, args.seed)
    if device.type != "cpu":
        raise SystemExit(
            "dyn_plugin.bench.train_megatron runs on CPU ranks (gloo, fp32), as the profile it is priced by"
        )
    os.makedirs(args.out, exist_ok=True)
    docs, lengths = tokenized_corpus(args.lengths, args.max_len, args.out)
    records = []
    for mode in modes:
        records += run_mode(mode, args, ex, docs, lengths, device)
    if dist.get_rank() == 0:
        finish_batchings(records, MODES, BASELINES, args.out, preamble(args), budget=args.global_tokens)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as the test workers: megatron-core's exit handlers are not needed


if __name__ == "__main__":
    main()
