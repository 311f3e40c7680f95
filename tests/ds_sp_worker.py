"""One rank of the sequence-parallel DeepSpeed tests (run as a script): planned steps with forced
groupings of the ranks into sequence-parallel groups, compared with the single-process token-mean
reference; then, optionally, a run with dropout that records the random state each group draws,
stopped by a kill after a checkpoint or resumed from it. With "plugin" (extra dyn_plugin sections,
e.g. a strategy proposal), the exact cases plan as that config says for "count" steps instead of
forced ones, and may be stopped by a kill after a checkpoint or resumed from it too.

    ds_sp_worker.py OUT_DIR TAG JOB_JSON
    JOB_JSON: {"exact": [{"zero": z, "steps": [[grouping, layout], ...]}, ...],
               "dropout": null | "full" | "stop-after:K" | "resume"}
          or: {"plugin": {section: {...}},
               "exact": [{"zero": z, "count": n, "mode": "full" | "stop-after:K" | "resume"}, ...]}
Rank 0 writes OUT_DIR/TAG.json.
"""

import copy
import hashlib
import itertools
import json
import os
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist

import deepspeed_ext
from deepspeed_ext.state import state_of

deepspeed_ext.skip_cpu_shm_build()

import deepspeed  # noqa: E402

from ds_exact_worker import LR, MODEL, random_dataset, reference  # noqa: E402
from dyn_plugin.models.hf import build_causal_lm  # noqa: E402
from dyn_plugin.plan.methods import registry as methods  # noqa: E402
from dyn_plugin.plan.methods.planner import plan_step  # noqa: E402
from dyn_plugin.plan.steps.pricing import make_micro_batch  # noqa: E402
from dyn_plugin.plan.steps.schedule import one_f_one_b  # noqa: E402
from dyn_plugin.plan.steps.simulator import simulate  # noqa: E402
from dyn_plugin.plan.steps.types import ReplicaPlan, StepPlan  # noqa: E402
from ranks import finish  # noqa: E402

PER_GROUP = 2  # micro-batches per group: equal counts, as ZeRO-2/3 need
# (recompute, checkpointed layers of the one stage) by micro-batch index: whole-stage modes and a
# pyramid count (the first of MODEL's 2 layers under selective recompute, the other with none)
MODES = (("full", None), ("none", None), ("selective", (1,)))
STEPS = 4  # of the dropout run


def hand_plan(lens, spec, grouping, layout, step) -> StepPlan:
    """The global batch over groups of ``grouping`` columns: sequences longest first to the group
    with the fewest tokens per rank, then PER_GROUP micro-batches per group, recompute mixed
    (recompute in backward must re-run attention over its own micro-batch's group): MODES by step
    and micro-batch index, alike on every rank, since ZeRO-3 gathers each module's parameters over
    all ranks in the order modules run, and recompute changes that order."""
    load, members = [0.0] * len(grouping), [[] for _ in grouping]
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        g = min(range(len(grouping)), key=lambda g: (load[g] / grouping[g], g))
        members[g].append(i)
        load[g] += lens[i]
    replicas = []
    firsts = np.cumsum((0,) + tuple(grouping[:-1]))  # laid out in order; the groupings given are aligned
    for g, (k, first) in enumerate(zip(grouping, firsts.tolist())):
        chunks = [c.tolist() for c in np.array_split(members[g], PER_GROUP)]
        modes = [MODES[(j + step) % len(MODES)] for j in range(len(chunks))]
        mbs = tuple(
            make_micro_batch(c, lens, spec=spec, layout=layout, recompute=rc, sp=k, checkpointed=layers)
            for c, (rc, layers) in zip(chunks, modes)
        )
        schedule = one_f_one_b(len(mbs), spec.pp)
        replicas.append(ReplicaPlan(mbs, schedule, simulate(mbs, schedule, spec.link), first=first, size=k))
    return StepPlan("dynapipe", layout, tuple(replicas), spec.update_ms)


def planner_plan(lens, spec, grouping, layout, step) -> StepPlan:
    """The plugin's planner, held to ``grouping`` (it picks layouts, micro-batches, recompute)."""
    return plan_step(lens, spec, grouping=grouping)


def force_groupings(loader, steps, planner=hand_plan) -> None:
    """Step s of the loader plans ``planner(lengths, spec, *steps[s % len(steps)], s)`` ((grouping,
    layout) pairs), through the loader's own planning path (execution plans, checks, digests)."""
    plan = loader.context.plan

    def forced(epoch, step):
        saved = methods.plan_step
        methods.plan_step = lambda lens, spec: planner(lens, spec, *steps[step % len(steps)], step)
        try:
            return plan(epoch, step)
        finally:
            methods.plan_step = saved

    loader.context.plan = forced


def engine_for(model, stage, data, lengths, optimizer, seed=3, plugin=None):
    config = {
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "dyn_plugin": {
            # global batches cut as the cases were chosen for: consecutive samples (no lookahead)
            "microbatching": {"global_tokens": 1000, "max_seq_len": 256, "lookahead": 0},
            "cost_model": {"kind": "analytic", "dtype": "fp32"},
            "sequence_parallel": {"enabled": True, "sizes": [1, 2, 4], "attention": "auto"},
            **(plugin or {}),
        },
    }
    return deepspeed_ext.initialize(
        model=model, config=config, dataset=data, lengths=lengths, optimizer=optimizer(model.parameters()), seed=seed
    )


def gather_objects(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def step_record(step) -> dict:
    """What this rank ran: its groups, (shard width, whole width, tokens of the fullest row) per
    micro-batch, the samples it holds shard 0 of, and (recompute, checkpointed layers) per micro-batch."""
    return {
        "shards": step.shards,
        "widths": [
            (mb["input_ids"].shape[1], d.shape[1], _row_tokens(d)) for mb, d in zip(step.micro_batches, step.loaded)
        ],
        "samples": [i for (_, _, index), ids in zip(step.shards, step.sample_ids) if index == 0 for i in ids],
        "modes": [(d.recompute, d.checkpointed) for d in step.loaded],
    }


def _row_tokens(desc) -> int:
    return sum(desc.seq_lens) if desc.layout == "packed" else max(desc.seq_lens)


def exact_case(case, data, lengths, out, plugin=None) -> dict:
    """The forced steps, or ``case["count"]`` steps planned as ``plugin`` says, against the
    reference. Mode "stop-after:K" checkpoints after K steps and dies; "resume" goes on from that
    checkpoint, the reference first replaying the steps the checkpoint holds."""
    stage, planned = case["zero"], [(tuple(g), layout) for g, layout in case.get("steps", [])]
    mode = case.get("mode", "full")
    torch.manual_seed(0)
    model = build_causal_lm(MODEL)
    ref = copy.deepcopy(model)
    engine, _, loader, _ = engine_for(model, stage, data, lengths, lambda p: torch.optim.SGD(p, lr=LR), plugin=plugin)
    if planned:
        force_groupings(loader, planned)
    ckpt = os.path.join(out, "ckpt")
    if mode == "resume":
        deepspeed_ext.load_checkpoint(engine, loader, ckpt)
        for done in loader.context.batches(loader.epoch)[: loader.step]:
            reference(ref, [data[int(i)]["input_ids"] for i in done], LR)
    stop = int(mode.split(":")[1]) if mode.startswith("stop-after") else None
    steps = []
    for n, step in zip(range((len(planned) or case["count"]) - loader.step), loader):
        deepspeed_ext.train_step(engine, step)
        batch = [int(i) for i in loader.context.batches(step.epoch)[step.index]]
        reference(ref, [data[i]["input_ids"] for i in batch], LR)
        records = gather_objects(step_record(step))
        grouping, layout = planned[step.index] if planned else (None, None)
        steps.append(
            {
                "index": step.index,
                "grouping": grouping,
                "layout": layout,
                "batch": sorted(batch),
                "ranks": records,
                "digest": step.digest,
            }
        )
        if stop is not None and n + 1 == stop:
            deepspeed_ext.save_checkpoint(engine, loader, ckpt, tag="crash")
            os.kill(os.getpid(), signal.SIGKILL)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        diff = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(params, ref.parameters()))
        weights = hashlib.sha256(torch.cat([p.detach().flatten() for p in params]).numpy().tobytes()).hexdigest()
    engine.destroy()
    return {
        **case,
        "max_abs_diff": diff,
        "steps": steps,
        "kinds": state_of(engine).sequence.kinds,
        "weights": weights,
    }


def dropout_run(out, mode) -> list:
    """AdamW with attention dropout, the planner's plans on alternating groupings: each micro-batch
    draws a value at the start of its forward; a kill after a checkpoint and a resume must plan
    and draw the same and end on the same weights."""
    lengths, data = random_dataset(0)
    torch.manual_seed(0)
    model = build_causal_lm({**MODEL, "attention_dropout": 0.2})
    engine, _, loader, _ = engine_for(model, 1, data, lengths, lambda p: torch.optim.AdamW(p, lr=1e-2), seed=5)
    force_groupings(loader, [((2,), None), ((1, 1), None)], planner_plan)
    drawn = []
    engine.module.register_forward_pre_hook(lambda *_: drawn.append(float(torch.rand(()))))
    ckpt = os.path.join(out, "ckpt")
    if mode == "resume":
        deepspeed_ext.load_checkpoint(engine, loader, ckpt)
    stop = int(mode.split(":")[1]) if mode.startswith("stop-after") else None
    steps = []
    for n, step in enumerate(itertools.islice(loader, STEPS - loader.step)):
        drawn.clear()
        deepspeed_ext.train_step(engine, step)
        steps.append(
            gather_objects({"step": step.index, "digest": step.digest, "shards": step.shards, "drawn": list(drawn)})
        )
        if stop is not None and n + 1 == stop:
            deepspeed_ext.save_checkpoint(engine, loader, ckpt, tag="crash")
            os.kill(os.getpid(), signal.SIGKILL)
    flat = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    if dist.get_rank() == 0:
        torch.save(flat, os.path.join(out, f"params-{mode}.pt"))
    return steps


def main():
    out, tag, job = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    deepspeed.init_distributed(dist_backend="gloo")
    lengths, data = random_dataset(0)
    results = {"exact": [exact_case(case, data, lengths, out, job.get("plugin")) for case in job.get("exact", [])]}
    if job.get("dropout"):
        results["dropout"] = dropout_run(out, job["dropout"])
    finish(results, os.path.join(out, f"{tag}.json"))


if __name__ == "__main__":
    main()
