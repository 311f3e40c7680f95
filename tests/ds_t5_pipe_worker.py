"""One rank of the encoder-decoder pipeline exactness test: a tiny random T5 trained on
(input, target) pairs by ``deepspeed_ext.initialize`` with ``pipeline.stages`` 2 (an encoder stage,
then a decoder stage; dp = world / 2; ``$T5_PIPE_SCHEDULE`` its pipeline.schedule, default auto), an
epoch of planned steps, every step's parameters compared
with the unmodified model trained in one process on the whole global batch (run as a script).

The pair planner prices the pipeline with the A100 T5 tables cut to the tiny model's shape (its
depth and width: the plan's link shapes are the model's; prices do not change the gradients)."""

import copy
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

import deepspeed_ext

deepspeed_ext.skip_cpu_shm_build()

from ds_t5_worker import T5, planned_pairs  # noqa: E402
from dyn_plugin.cost.bundled import DIR  # noqa: E402
from dyn_plugin.cost.encoder_decoder import import_t5_tables  # noqa: E402
from dyn_plugin.host.recompute import recompute_switch  # noqa: E402
from dyn_plugin.models.hf import build_seq2seq_lm  # noqa: E402
from dyn_plugin.plan.steps.instructions import EXCHANGES, BackwardInput  # noqa: E402
from ranks import finish  # noqa: E402
from token_mean import LR, reference  # noqa: E402


def tiny_cost():
    """The T5 tables priced for the tiny model's 2 + 2 layers of width 32, in fp32."""
    tables = import_t5_tables(DIR / "measured" / "a100-t5-11b.json")
    return dataclasses.replace(
        tables,
        encoder_layers=T5["num_layers"],
        decoder_layers=T5["num_decoder_layers"],
        hidden_size=T5["d_model"],
        vocab_size=T5["vocab_size"],
        dtype="fp32",
    )


def run(zero: int, recompute: str, pairs, data, world: int, stages: int, ckpt: str) -> dict:
    torch.manual_seed(0)
    model = build_seq2seq_lm(T5)
    ref = copy.deepcopy(model)
    config = {
        "zero_optimization": {"stage": zero},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # off: the reference does not clip
        "dyn_plugin": {
            "microbatching": {
                "global_tokens": int(pairs.sum()) // 2 + 50,
                "max_seq_len": 512,
                "recompute": recompute,
            },
            "pipeline": {"stages": stages, "schedule": os.environ.get("T5_PIPE_SCHEDULE", "auto")},
            "cluster": {"device": {"memory_mb": 400000}},  # T5 11B-sized layers' states fit a stage
        },
    }
    engine, _, loader, _ = deepspeed_ext.initialize(
        model=model,
        config=config,
        dataset=data,
        lengths=pairs,
        optimizer=lambda params: torch.optim.SGD(params, lr=LR),
        cost_model=tiny_cost(),
        seed=3,
    )
    local = {id(p) for p in engine.module.parameters()}
    initial = [p.detach().clone() for p in engine.module.parameters()]
    diffs, trained, counts, links, losses, split = [], [], [], set(), [], 0
    for step in loader:
        if not losses:  # forward-only first: the same loss, no update
            eval_loss = engine.eval_batch(step)
        loss = deepspeed_ext.train_step(engine, step)
        mine = [i for mb in step.sample_ids for i in mb] if engine.is_first_stage() else []
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        ids = sorted(i for g in gathered for i in g)
        samples = [(data[i]["input_ids"], data[i]["labels"]) for i in ids]
        with torch.no_grad():  # the reference's token mean before its update
            want = sum(
                float(ref(input_ids=torch.as_tensor(s)[None], labels=torch.as_tensor(t)[None], use_cache=False).loss)
                * len(t)
                for s, t in samples
            ) / sum(len(t) for _, t in samples)
        reference(ref, samples, LR)
        diff = max(
            float((p.detach() - q.detach()).abs().max())
            for p, q in zip(model.parameters(), ref.parameters())
            if id(p) in local
        )
        diffs.append(diff)
        trained.append(ids)
        counts.append(len(step.plan.micro_batches))
        split += sum(isinstance(i, BackwardInput) for i in step.plan.instructions)
        losses.append((loss, want))
        links |= {(type(i).__name__, len(i.shapes)) for i in step.plan.instructions if isinstance(i, EXCHANGES)}
    # DeepSpeed's pipeline checkpoint (per layer, tied layers included) and the loader position round-trip
    deepspeed_ext.save_checkpoint(engine, loader, ckpt)
    saved = [p.detach().clone() for p in engine.module.parameters()]
    with torch.no_grad():
        for p in engine.module.parameters():
            p.add_(1.0)
    deepspeed_ext.load_checkpoint(engine, loader, ckpt)
    restored = max(float((p.detach() - q).abs().max()) for p, q in zip(engine.module.parameters(), saved))
    stats = torch.tensor(diffs, dtype=torch.float64)
    every = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(every, stats)
    compared, moved, transfers = [None] * world, [None] * world, [None] * world
    dist.all_gather_object(compared, len(local))
    dist.all_gather_object(transfers, sorted(links))
    restores = [None] * world
    dist.all_gather_object(restores, restored)
    mine = max(float((p.detach() - q).abs().max()) for p, q in zip(engine.module.parameters(), initial))
    dist.all_gather_object(moved, mine)
    return {
        "zero": zero,
        "recompute": recompute,
        "recompute_ran": recompute_switch(engine.module).mode,
        "max_abs_diff": torch.stack(every).max(dim=0).values.tolist(),  # per step, over every rank's parameters
        "params_local": compared,
        "moved": moved,  # per rank: the largest change of its parameters over the epoch
        "params": len(list(model.parameters())),
        "trained": trained,
        "micro_batches": counts,
        "losses": losses,
        "eval_loss": eval_loss,
        "restored_diff": max(restores),  # after a save, a perturbation and a load
        "links": transfers,  # per rank, its transfers: (instruction, tensors it moves)
        "dp": engine.dp_world_size,
        "stages": engine.num_stages,
        "split": split,  # this rank's backwards run as I and W over the epoch
    }


def main():
    out, stages = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    pairs, data = planned_pairs(0, 24)
    ckpt = os.path.join(os.path.dirname(out), "ckpt-{}")
    results = [run(z, rc, pairs, data, world, stages, ckpt.format(z)) for z, rc in ((0, "none"), (1, "full"))]
    finish({"cases": results, "samples": len(pairs)}, out)


if __name__ == "__main__":
    main()
