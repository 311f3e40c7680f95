"""One rank of the encoder-decoder exactness test: a tiny random T5 trained on (input, target)
pairs under DeepSpeed's engine, ZeRO 0-3, every step's parameters compared with the unmodified
model trained in one process on the whole global batch (run as a script).

Two kinds of case. Hand-made plans: each rank's micro-batches are PlannedMicroBatch descriptions
with pair lengths and ``pair_shape`` shapes, turned into tensors by the loader's own
``load_micro_batch`` and run by ``deepspeed_ext.train_step``, split unevenly within a rank, between
the ranks and between the steps (equal counts per rank: ZeRO-2/3 need them), with recompute
switched per micro-batch. Planned: ``deepspeed_ext.initialize`` with pair lengths, the plugin's
loader planning an epoch with the encoder-decoder planner (the A100 T5 11B tables price it; their
precision set to the run's, which the plugin checks: prices do not change the gradients), one case
saving a checkpoint after the first step and resuming a fresh engine and loader from it."""

import copy
import dataclasses
import sys

import numpy as np
import torch
import torch.distributed as dist

import deepspeed_ext

deepspeed_ext.skip_cpu_shm_build()

import deepspeed  # noqa: E402

from dyn_plugin.cost.bundled import DIR  # noqa: E402
from dyn_plugin.cost.encoder_decoder import import_t5_tables, pair_shape  # noqa: E402
from dyn_plugin.host.recompute import recompute_switch  # noqa: E402
from dyn_plugin.models.hf import PRESETS, build_seq2seq_lm  # noqa: E402
from dyn_plugin.plan.steps.instructions import (  # noqa: E402
    ExecutionPlan,
    LoadMicroBatch,
    OptimizerStep,
    PlannedMicroBatch,  # noqa: E402
)
from dyn_plugin.runtime.collate import scored_tokens  # noqa: E402
from dyn_plugin.runtime.loader import Step, load_micro_batch  # noqa: E402
from ranks import finish  # noqa: E402
from token_mean import LR, global_samples, reference  # noqa: E402

T5 = dict(PRESETS["tiny-t5"], d_model=32, d_kv=8, d_ff=64, vocab_size=97)
# (config, SGD learning rate). T5 v1.1 (gated-GELU; tie_word_embeddings=False, which transformers 5
# reads as no rescaling only, the head stays tied) does not rescale its logits by
# d_model^-0.5 as tied T5 does: it starts at a loss of ~19, not ~5, with gradients to match, so it
# steps at a tenth of the rate to move its parameters as far as T5 does at LR (float summation
# differences grow with the step).
VARIANTS = {"t5": (T5, LR), "t5-v1.1": (dict(T5, feed_forward_proj="gated-gelu", tie_word_embeddings=False), LR / 10)}
# per step, per rank: the sizes of its micro-batches, in order (sum: the global batch, 10 pairs)
SPLITS = (((3, 2), (1, 4)), ((2, 1, 1), (1, 1, 3)))
# the recompute mode of the micro-batch at each index (alike on every rank, as ZeRO-3 needs)
RECOMPUTE = {0: ("none",), 1: ("full", "selective"), 2: ("selective", "none", "full"), 3: ("full", "none", "none")}


def random_pairs(seed: int, count: int) -> list[dict]:
    """Pairs of 1-40 input and 1-40 target tokens, lengths drawn apart (ids 2..96: 0 pads, 1 ends)."""
    rng = np.random.default_rng(seed)
    return [
        {"input_ids": rng.integers(2, 97, size=int(a)), "labels": rng.integers(2, 97, size=int(b))}
        for a, b in rng.integers(1, 41, size=(count, 2))
    ]


def planned_steps(data: list[dict], rank: int, stage: int) -> list[Step]:
    """This rank's two steps: an epoch's shuffled samples cut as SPLITS says."""
    order = np.random.default_rng(stage).permutation(len(data)).tolist()
    pairs = [(len(d["input_ids"]), len(d["labels"])) for d in data]
    steps, start = [], 0
    for index, per_rank in enumerate(SPLITS):
        batch = order[start : start + sum(map(sum, per_rank))]
        start += len(batch)
        first = sum(sum(sizes) for sizes in per_rank[:rank])
        cursor, descs = first, []
        for k, size in enumerate(per_rank[rank]):
            ids = tuple(batch[cursor : cursor + size])
            cursor += size
            lens = tuple(pairs[i] for i in ids)
            modes = RECOMPUTE[stage]
            descs.append(
                PlannedMicroBatch(ids, lens, "padded", modes[k % len(modes)], pair_shape(*zip(*lens)), (), 1, rank)
            )
        plan = ExecutionPlan(
            rank,
            rank,
            0,
            1,
            1,
            tuple(LoadMicroBatch(0, mb=k) for k in range(len(descs))) + (OptimizerStep(0),),
            tuple(descs),
        )
        loaded = [load_micro_batch(d, data.__getitem__, column=rank) for d in descs]
        scored = scored_tokens([pairs[i] for i in batch])
        steps.append(Step(0, index, plan, loaded, [list(d.sample_ids) for d in descs], scored, "", 0.0))
    assert start == len(data), "the steps cover the epoch"
    return steps


def run_case(stage: int, variant: str, data: list[dict], rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model_config, lr = VARIANTS[variant]
    model = build_seq2seq_lm(model_config)
    ref = copy.deepcopy(model)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # off: the reference does not clip
    }
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        config=config,
        dist_init_required=False,
    )
    diffs, losses, sizes, trained = [], [], [], []
    for step in planned_steps(data, rank, stage):
        loss = deepspeed_ext.train_step(engine, step)
        ids = global_samples(step, world)
        trained += ids
        samples = [(data[i]["input_ids"], data[i]["labels"]) for i in ids]
        with torch.no_grad():  # the reference's loss before its update: the step's token mean
            ref_loss = reference_loss(ref, samples)
        reference(ref, samples, lr)
        diffs.append(param_diff(engine, ref, stage))
        losses.append((loss, ref_loss))
        sizes.append([len(s) for s in step.sample_ids])
    ran = recompute_switch(engine.module).mode
    engine.destroy() if hasattr(engine, "destroy") else None
    return {
        "recompute_ran": ran,
        "recompute_last": step.loaded[-1].recompute,
        "blocks": len(recompute_switch(engine.module).layers),
        "stage": stage,
        "variant": variant,
        "max_abs_diff": diffs,
        "losses": losses,
        "micro_batch_sizes": sizes,
        "trained": trained,
    }


def planned_pairs(seed: int, count: int) -> tuple[np.ndarray, list[dict]]:
    """Pairs long and varied enough for the planner to cut each rank's share into several micro-batches."""
    rng = np.random.default_rng(seed)
    pairs = np.stack([rng.integers(8, 400, count), rng.integers(4, 200, count)], axis=1)
    return pairs, [{"input_ids": rng.integers(2, 97, size=a), "labels": rng.integers(2, 97, size=b)} for a, b in pairs]


def planned_engine(stage: int, pairs: np.ndarray, data: list[dict], cost, init_seed: int = 0):
    torch.manual_seed(init_seed)
    model = build_seq2seq_lm(T5)
    ref = copy.deepcopy(model)
    config = {
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "dyn_plugin": {
            # global batches cut as the cases below were chosen for: consecutive pairs (no lookahead)
            "microbatching": {"global_tokens": int(pairs.sum()) // 2 + 50, "max_seq_len": 512, "lookahead": 0},
            "cluster": {"device": {"memory_mb": 400000}},  # T5 11B's states fit one stage
        },
    }
    engine, _, loader, _ = deepspeed_ext.initialize(
        model=model,
        config=config,
        dataset=data,
        lengths=pairs,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        cost_model=cost,
        seed=3,
    )
    return engine, loader, ref


def run_planned(stage: int, pairs, data, cost, world: int, resume_dir: str | None = None) -> dict:
    """An epoch planned by the loader; with ``resume_dir``, a checkpoint after the first step, from
    which a fresh engine (other initial weights) and loader finish the epoch."""
    engine, loader, ref = planned_engine(stage, pairs, data, cost)
    diffs, sizes, trained, resumed = [], [], [], None  # trained: each step's samples
    for step in loader:
        deepspeed_ext.train_step(engine, step)
        ids = global_samples(step, world)
        trained.append(ids)
        reference(ref, [(data[i]["input_ids"], data[i]["labels"]) for i in ids], LR)
        diffs.append(param_diff(engine, ref, stage))
        sizes.append([len(s) for s in step.sample_ids])
        if resume_dir is not None and step.index == 0:
            deepspeed_ext.save_checkpoint(engine, loader, resume_dir)
    if resume_dir is not None:
        fresh, again, _ = planned_engine(stage, pairs, data, cost, init_seed=1)
        deepspeed_ext.load_checkpoint(fresh, again, resume_dir)
        rest = []
        for step in again:
            deepspeed_ext.train_step(fresh, step)
            rest.append(global_samples(step, world))
        resumed = {"diff": param_diff(fresh, engine, stage, other_sharded=True), "trained": rest}
    return {"stage": stage, "max_abs_diff": diffs, "micro_batch_sizes": sizes, "trained": trained, "resumed": resumed}


def param_diff(engine, ref, stage: int, other_sharded: bool = False) -> float:
    """Largest parameter difference between ``engine`` and ``ref`` (a module, or another engine)."""
    params = list(engine.module.parameters())
    theirs = list((ref.module if other_sharded else ref).parameters())
    with deepspeed.zero.GatheredParameters(params + (theirs if other_sharded else []), enabled=stage == 3):
        return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(params, theirs))


def reference_loss(model, samples) -> float:
    """The token mean over every target token of the global batch, each pair alone."""
    total = sum(len(t) for _, t in samples)
    return (
        sum(
            float(model(input_ids=torch.as_tensor(s)[None], labels=torch.as_tensor(t)[None], use_cache=False).loss)
            * len(t)
            for s, t in samples
        )
        / total
    )


def main():
    out = sys.argv[1]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = random_pairs(0, sum(sum(map(sum, s)) for s in SPLITS))
    results = [run_case(stage, "t5", data, rank, world) for stage in (0, 1, 2, 3)]
    results += [run_case(stage, "t5-v1.1", data, rank, world) for stage in (1, 3)]
    cost = dataclasses.replace(import_t5_tables(DIR / "measured" / "a100-t5-11b.json"), dtype="fp32")
    pairs, planned_data = planned_pairs(0, 24)
    resume = sys.argv[2]
    planned = [
        run_planned(stage, pairs, planned_data, cost, world, resume if stage == 1 else None) for stage in range(4)
    ]
    finish({"cases": results, "samples": len(data), "planned": planned, "planned_samples": len(pairs)}, out)


if __name__ == "__main__":
    main()
