"""One rank of the packed-pairs exactness test: a tiny random T5 trained on rows of several whole
(input, target) pairs under DeepSpeed's engine, every step's parameters compared with the
unmodified model trained in one process on each pair alone (run as a script).

- "zero1 packing_full": ``deepspeed_ext.initialize`` with pair lengths and microbatching.method
  packing_full, so the loader plans an epoch with the pair_packing baseline (T5 packing per side,
  rows of max_seq_len; the A100 T5 11B tables price it, their precision set to the run's), ZeRO-1.
- "zero3 packed": hand-made packed plans (equal counts per rank, as ZeRO-3 needs, recompute
  switched per micro-batch) under ZeRO-3, whose parameters are fetched inside the engine's forward.
"""

import copy
import dataclasses
import sys

import numpy as np
import torch
import torch.distributed as dist

import deepspeed_ext

deepspeed_ext.skip_cpu_shm_build()

import deepspeed  # noqa: E402

from ds_t5_worker import T5, param_diff, planned_pairs, random_pairs, reference_loss  # noqa: E402
from dyn_plugin.cost.bundled import DIR  # noqa: E402
from dyn_plugin.cost.encoder_decoder import import_t5_tables, packed_pair_shape  # noqa: E402
from dyn_plugin.models.hf import build_seq2seq_lm  # noqa: E402
from dyn_plugin.plan.steps.instructions import ExecutionPlan, LoadMicroBatch, OptimizerStep, PlannedMicroBatch  # noqa: E402
from dyn_plugin.runtime.collate import scored_tokens  # noqa: E402
from dyn_plugin.runtime.loader import Step, load_micro_batch  # noqa: E402
from ranks import finish  # noqa: E402
from token_mean import LR, global_samples, reference  # noqa: E402

WIDTHS = (48, 48)  # hand-made rows: two to four pairs of 1-40 tokens a side
SPLITS = (((3, 2), (2, 3)), ((4, 1), (1, 4)))  # per step, per rank: pairs per micro-batch
RECOMPUTE = ("full", "none")


def train(name: str, engine, steps, data, ref, world: int) -> dict:
    """Each step on the engine and on the reference (each pair alone), compared after each."""
    diffs, losses, trained, layouts, shared = [], [], [], set(), False
    stage = engine.zero_optimization_stage()
    for step in steps:
        loss = deepspeed_ext.train_step(engine, step)
        ids = global_samples(step, world)
        samples = [(data[i]["input_ids"], data[i]["labels"]) for i in ids]
        with torch.no_grad():  # the reference's loss before its update: the step's token mean
            losses.append((loss, reference_loss(ref, samples)))
        reference(ref, samples, LR)
        diffs.append(param_diff(engine, ref, stage))
        trained.append(ids)
        layouts |= {d.layout for d in step.loaded}
        shared |= any(d.shape[0] < len(d.sample_ids) for d in step.loaded)
    shared_anywhere = torch.tensor(int(shared))
    dist.all_reduce(shared_anywhere)
    return {
        "name": name,
        "max_abs_diff": diffs,
        "losses": losses,
        "trained": trained,
        "samples": len(data),
        "layouts": sorted(layouts),
        "rows_shared": bool(shared_anywhere),
    }


def baseline_case(world: int) -> dict:
    """The pair_packing baseline planned by the loader, ZeRO-1."""
    pairs, data = planned_pairs(0, 24)
    cost = dataclasses.replace(import_t5_tables(DIR / "measured" / "a100-t5-11b.json"), dtype="fp32")
    torch.manual_seed(0)
    model = build_seq2seq_lm(T5)
    ref = copy.deepcopy(model)
    config = {
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # off: the reference does not clip
        "dyn_plugin": {
            "microbatching": {
                "method": "packing_full",
                "global_tokens": int(pairs.sum()) // 2 + 50,
                "max_seq_len": 512,
            },
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
    return train("zero1 packing_full", engine, loader, data, ref, world)


def packed_steps(data: list[dict], rank: int) -> list[Step]:
    """This rank's steps: shuffled pairs cut as SPLITS says, each micro-batch packed into rows of WIDTHS."""
    order = np.random.default_rng(1).permutation(len(data)).tolist()
    pairs = [(len(d["input_ids"]), len(d["labels"])) for d in data]
    steps, start = [], 0
    for index, per_rank in enumerate(SPLITS):
        batch = order[start : start + sum(map(sum, per_rank))]
        start += len(batch)
        cursor, descs = sum(sum(sizes) for sizes in per_rank[:rank]), []
        for k, size in enumerate(per_rank[rank]):
            ids = tuple(batch[cursor : cursor + size])
            cursor += size
            lens = tuple(pairs[i] for i in ids)
            shape = packed_pair_shape(*zip(*lens), WIDTHS)
            descs.append(PlannedMicroBatch(ids, lens, "packed", RECOMPUTE[k], shape, (), 1, rank))
        instructions = tuple(LoadMicroBatch(0, mb=k) for k in range(len(descs))) + (OptimizerStep(0),)
        plan = ExecutionPlan(rank, rank, 0, 1, 1, instructions, tuple(descs))
        loaded = [load_micro_batch(d, data.__getitem__, column=rank) for d in descs]
        scored = scored_tokens([pairs[i] for i in batch])
        steps.append(Step(0, index, plan, loaded, [list(d.sample_ids) for d in descs], scored, "", 0.0))
    return steps


def zero3_case(rank: int, world: int) -> dict:
    data = random_pairs(2, sum(sum(map(sum, s)) for s in SPLITS))
    torch.manual_seed(0)
    model = build_seq2seq_lm(T5)
    ref = copy.deepcopy(model)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config, dist_init_required=False
    )
    return train("zero3 packed", engine, packed_steps(data, rank), data, ref, world)


def main():
    out = sys.argv[1]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    finish([baseline_case(world), zero3_case(rank, world)], out)


if __name__ == "__main__":
    main()
