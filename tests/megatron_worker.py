"""One gloo rank of a Megatron run under the plugin's patches, or the single-process reference.

    megatron_worker.py train OUT PP METHOD RECOMPUTE STEPS   (every rank)
    megatron_worker.py reference OUT PP STEPS                (world 1)

``train`` trains the example's megatron-core GPT (examples/megatron_gpt/train.py: its model,
forward step and loss function) on random documents of fixed lengths with SGD, through Megatron's
own schedules patched by the plugin, and writes each stage's initial and final weights and each
step's global batch. ``reference`` replays those global batches on one process: every document
alone, the summed loss over the global batch's scored tokens, the same SGD update; it writes the
largest difference from the trained weights.
"""

import json
import os
import runpy
import sys
from argparse import Namespace

import numpy as np
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "megatron_gpt", "train.py")
LENGTHS = [int(x) for x in np.random.default_rng(0).integers(3, 160, size=48)]
LR = 0.05
SHAPE = Namespace(layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq_length=512, recompute=False)


def documents():
    rng = np.random.default_rng(1)
    return [rng.integers(1, SHAPE.vocab, size=n).astype(np.int64) for n in LENGTHS]


def plugin_config(pp: int, method: str, recompute: str) -> dict:
    memory = float(os.environ.get("MEGATRON_TEST_MEMORY_MB", 8000))
    mb = {
        "global_tokens": int(os.environ.get("MEGATRON_TEST_GLOBAL_TOKENS", 1200)),
        "max_seq_len": 256,
        "method": method,
    }
    if recompute != "auto":
        mb["recompute"] = recompute
    if method == "dynapipe":  # the cases check packed rows: a padded plan (a baseline's, when faster) is not one
        mb["layout"] = "packed"
    return {
        "dyn_plugin": {
            "cost_model": {"kind": "analytic"},
            "microbatching": mb,
            "pipeline": {"stages": pp, "schedule": os.environ.get("MEGATRON_TEST_SCHEDULE", "auto")},
            "cluster": {"devices_per_node": 4, "device": {"memory_mb": memory}},
        }
    }


def stage_weights(model) -> dict:
    """This stage's parameters under the full model's names (layer numbers global)."""
    from megatron_patches.runtime import unwrap

    chunk = unwrap(model)
    out = {}
    for name, p in chunk.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:  # layer_number: global, from 1
            parts[2] = str(chunk.decoder.layers[int(parts[2])].layer_number - 1)
        out[".".join(parts)] = p.detach().clone()
    return out


def train(out: str, pp: int, method: str, recompute: str, steps: int) -> None:
    import megatron_patches
    from megatron_patches import runtime

    megatron_patches.apply(plugin_config(pp, method, recompute))
    ex = runpy.run_path(EXAMPLE)
    ex["initialize"](1, pp, 0)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    runtime.RUN.set_documents(runtime.Documents(documents(), np.array(LENGTHS)))
    model = ex["model_provider"](SHAPE)
    stage, first_column = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank() == 0
    if first_column:
        torch.save(stage_weights(model), os.path.join(out, f"init-{stage}.pt"))
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
        OptimizerConfig(optimizer="sgd", lr=LR, weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0), [model]
    )
    forward_backward = get_forward_backward_func()
    records = []
    for _ in range(steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(
            forward_step_func=ex["forward_step"],
            data_iterator=iter([]),
            model=model,
            num_microbatches=1,
            seq_length=SHAPE.seq_length,
            micro_batch_size=1,
            forward_only=False,
        )
        optimizer.step()
        step = runtime.RUN.step
        counts = torch.tensor([len(step.plan.micro_batches)])
        gathered = [torch.zeros_like(counts) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, counts)
        records.append(
            {
                "samples": [int(i) for i in runtime.RUN.loader.context.batches(step.epoch)[step.index]],
                "counts": [int(c) for c in gathered],
                "layouts": sorted({d.layout for d in step.plan.micro_batches}),
                "recompute": sorted({d.recompute for d in step.plan.micro_batches}),
                "shapes": [list(d.shape) for d in step.plan.micro_batches],
                "split": sum(type(i).__name__ == "BackwardInput" for i in step.plan.instructions),
                # steps whose micro-batches the online calibration was handed (timed without a pipeline)
                "observed": len(runtime.RUN.loader.calibration.errors),
            }
        )
    if first_column:
        torch.save(stage_weights(model), os.path.join(out, f"final-{stage}.pt"))
    if dist.get_rank() == 0:
        with open(os.path.join(out, "steps.json"), "w") as f:
            json.dump(records, f)
    dist.barrier()
    dist.destroy_process_group()


def merged(out: str, kind: str, pp: int) -> dict:
    weights = {}
    for s in range(pp):
        weights.update(torch.load(os.path.join(out, f"{kind}-{s}.pt")))
    return weights


def reference(out: str, pp: int, steps: int) -> None:
    import megatron_patches

    megatron_patches.apply()
    ex = runpy.run_path(EXAMPLE)
    ex["initialize"](1, 1, 0)
    model = ex["model_provider"](SHAPE)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in merged(out, "init", pp).items():
            params[name].copy_(w)
    with open(os.path.join(out, "steps.json")) as f:
        records = json.load(f)
    docs = documents()
    for rec in records[:steps]:
        model.zero_grad()
        scored = sum(LENGTHS[i] - 1 for i in rec["samples"])
        total = 0.0
        for i in rec["samples"]:
            ids = torch.from_numpy(docs[i]).unsqueeze(0)
            labels = torch.zeros_like(ids)
            labels[:, :-1] = ids[:, 1:]
            losses = model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None, labels=labels)
            loss = losses[:, :-1].sum() / scored
            loss.backward()
            total += float(loss)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    final = merged(out, "final", pp)
    diff = max(float((params[n] - w).abs().max()) for n, w in final.items())
    moved = max(float((params[n] - w).abs().max()) for n, w in merged(out, "init", pp).items())
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"max_diff": diff, "moved": moved}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "train":
        train(out, int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6]))
    else:
        reference(out, int(sys.argv[3]), int(sys.argv[4]))
    os._exit(0)
