"""One rank of the pipeline sequence-parallel test: pp=2 x 2 columns, ZeRO-1, three steps through
one engine with the columns grouped [2], then [1, 1], then [2] (forced), each step compared with the
single-process token-mean reference (run as a script)."""

import copy
import functools
import itertools
import sys
import time

import torch
import torch.distributed as dist

import deepspeed_ext

deepspeed_ext.skip_cpu_shm_build()

import deepspeed  # noqa: E402

from ds_exact_worker import LR, MODEL, random_dataset, reference  # noqa: E402
from dyn_plugin.host.recompute import recompute_switch  # noqa: E402
from dyn_plugin.models.hf import build_causal_lm  # noqa: E402
from dyn_plugin.plan.methods import registry as methods  # noqa: E402
from dyn_plugin.runtime import planning  # noqa: E402
from ranks import finish  # noqa: E402

GROUPINGS = ((2,), (1, 1), (2,))  # step s of the epoch groups the 2 columns as GROUPINGS[s]
CASES = (  # layout, recompute (full: backward re-runs attention in its group), attention, device MB, schedule
    ("padded", "none", "ulysses", 4, "auto"),
    (
        "packed",
        "full",
        "ring",
        4,
        "auto",
    ),  # the ring prices its score chunks of 256 queries (cost/sequence_parallel.py)
    # backwards split into I and W: a split micro-batch's I (its recompute included) runs in its group
    ("packed", "full", "ring", 4, "zero_bubble"),
)


def force_groupings(context: planning.PlanningContext) -> None:
    """Plan global batch s with the columns grouped as GROUPINGS[s], where the planner would choose
    its own; PlanningContext.plan still checks every rank's plan (check_plans(rendezvous=True))."""
    plan, plan_step = context.plan, methods.plan_step

    def forced(epoch: int, step: int):
        methods.plan_step = functools.partial(plan_step, grouping=GROUPINGS[step])
        try:
            return plan(epoch, step)
        finally:
            methods.plan_step = plan_step

    context.plan = forced


@torch.no_grad()
def reference_loss(model, samples) -> float:
    total = sum(len(s) - 1 for s in samples)
    return (
        sum(
            float(
                model(
                    input_ids=torch.as_tensor(s).unsqueeze(0), labels=torch.as_tensor(s).unsqueeze(0), use_cache=False
                ).loss
            )
            * (len(s) - 1)
            for s in samples
        )
        / total
    )


def main():
    out = sys.argv[1]
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    lengths, data = random_dataset(1)
    results = []
    for layout, recompute, attention, memory_mb, schedule in CASES:
        torch.manual_seed(0)
        model = build_causal_lm({**MODEL, "num_hidden_layers": 3})
        ref = copy.deepcopy(model)
        config = {
            "zero_optimization": {"stage": 1},
            "zero_allow_untested_optimizer": True,
            "dyn_plugin": {
                "microbatching": {"layout": layout, "global_tokens": 1500, "max_seq_len": 256, "recompute": recompute},
                "pipeline": {"stages": 2, "schedule": schedule},
                "sequence_parallel": {"enabled": True, "sizes": [1, 2], "attention": attention},
                # a small device: the plan cuts the global batch into several micro-batches
                "cluster": {"device": {"memory_mb": memory_mb, "memory_fraction": 1.0}},
                "cost_model": {"kind": "analytic", "dtype": "fp32"},
            },
        }
        engine, _, loader, _ = deepspeed_ext.initialize(
            model=model,
            config=config,
            dataset=data,
            lengths=lengths,
            optimizer=lambda params: torch.optim.SGD(params, lr=LR),
            seed=3,
        )
        force_groupings(loader.context)
        columns = engine.dp_world_size
        # DeepSpeed's grid is stage-major, as the plans and the sequence-parallel groups assume
        stage_major = all(
            engine.grid._topo.get_rank(pipe=s, data=c) == s * columns + c
            for s in range(engine.num_stages)
            for c in range(columns)
        )
        ids, steps = [], []
        for step in itertools.islice(loader, len(GROUPINGS)):
            # every sample of the step once: from each group's first column (its other columns hold
            # shards of the same rows), on the first stage (the last loads the same samples)
            descs = step.plan.micro_batches
            mine = [i for d in descs for i in d.sample_ids if engine.is_first_stage() and step.plan.column == d.group]
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            step_ids = sorted(i for g in gathered for i in g)
            samples = [data[i]["input_ids"] for i in step_ids]
            want = reference_loss(ref, samples)
            # the forwards alone, without gradients (sharded too), before the step changes the weights
            eval_diff = abs(engine.eval_batch(step) - want)
            t0 = time.perf_counter()
            loss = deepspeed_ext.train_step(engine, step)
            seconds = time.perf_counter() - t0
            reference(ref, samples, LR)
            ids += step_ids
            steps.append(
                {
                    "sp": sorted({d.sp for d in descs}),
                    "micro_batches": len(descs),
                    "seconds": seconds,
                    "loss_diff": abs(loss - want),
                    "eval_diff": eval_diff,
                    "padding_documents": sum(d.layout == "packed" and d.shape[1] > sum(d.seq_lens) for d in descs),
                    "split": sum(type(i).__name__ == "BackwardInput" for i in step.plan.instructions),
                }
            )
        local = {id(p) for p in engine.module.parameters()}
        diffs = [
            float((p.detach() - q.detach()).abs().max())
            for (_, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())
            if id(p) in local
        ]
        stats = torch.tensor([max(diffs), len(diffs)], dtype=torch.float64)
        every = [torch.zeros_like(stats) for _ in range(world)]
        dist.all_gather(every, stats)
        results.append(
            {
                "layout": layout,
                "recompute": recompute,
                "attention": attention,
                "schedule": schedule,
                "stage_major": stage_major,
                "max_abs_diff": max(float(s[0]) for s in every),
                "params_compared": sum(int(s[1]) for s in every),
                "params": len(list(model.parameters())),
                "dp": columns,
                "samples": len(ids),
                "distinct": len(set(ids)),
                "global_batch": sum(len(b) for b in loader.context.batches(0)[: len(GROUPINGS)]),
                "steps": steps,
                "recompute_ran": recompute_switch(engine.module).mode,
            }
        )
    finish(results, out)


if __name__ == "__main__":
    main()
