"""One rank of the encoder-decoder exactness test: a tiny random T5 trained on (input, target)
pairs under DeepSpeed's engine, ZeRO 0-3, two steps each, every step's parameters compared with
the unmodified model trained in one process on the whole global batch (run as a script).

Plans are made here as the loader's are consumed: each rank's micro-batches are PlannedMicroBatch
descriptions with pair lengths and ``pair_shape`` shapes, turned into tensors by the loader's own
``load_micro_batch`` and run by ``deepspeed_ext.train_step``. The splits are uneven within a rank,
between the ranks and between the steps; the counts per rank are equal (ZeRO-2/3 need it)."""

import copy
import sys

import numpy as np
import torch
import torch.distributed as dist

import deepspeed_ext

deepspeed_ext.skip_cpu_shm_build()

import deepspeed  # noqa: E402

from dyn_plugin.cost.encoder_decoder import pair_shape  # noqa: E402
from dyn_plugin.host.recompute import recompute_switch  # noqa: E402
from dyn_plugin.models.hf import PRESETS, build_seq2seq_lm  # noqa: E402
from dyn_plugin.plan.instructions import (  # noqa: E402
    ExecutionPlan,
    LoadMicroBatch,
    OptimizerStep,
    PlannedMicroBatch,  # noqa: E402
)
from dyn_plugin.runtime.collate import scored_tokens  # noqa: E402
from dyn_plugin.runtime.loader import Step, load_micro_batch  # noqa: E402
from ranks import finish  # noqa: E402
from token_mean import LR, reference  # noqa: E402

T5 = dict(PRESETS["tiny-t5"], d_model=32, d_kv=8, d_ff=64, vocab_size=97)
# (config, SGD learning rate). T5 v1.1 (gated-GELU, untied head) does not rescale its logits by
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
        mine = [i for ids in step.sample_ids for i in ids]
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        ids = sorted(i for g in gathered for i in g)
        trained += ids
        samples = [(data[i]["input_ids"], data[i]["labels"]) for i in ids]
        with torch.no_grad():  # the reference's loss before its update: the step's token mean
            ref_loss = reference_loss(ref, samples)
        reference(ref, samples, lr)
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
            diffs.append(max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(params, ref.parameters())))
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
    finish({"cases": results, "samples": len(data)}, out)


if __name__ == "__main__":
    main()
