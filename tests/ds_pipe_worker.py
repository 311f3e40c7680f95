"""One rank of the pipeline exactness test: the plugin's PipelineEngine runs two planned steps
(pp=2, with dp = world / 2), compared with a single-process reference (run as a script:
``ds_pipe_worker.py OUT [SCHEDULE]``, the config's pipeline.schedule, default auto; zero_bubble
splits backwards where the plan says)."""

import copy
import dataclasses
import itertools
import os
import sys

import torch
import torch.distributed as dist

import deepspeed_ext

deepspeed_ext.skip_cpu_shm_build()

import deepspeed  # noqa: E402

from ds_exact_worker import LR, MODEL, random_dataset, reference  # noqa: E402
from dyn_plugin.host.recompute import recompute_switch  # noqa: E402
from dyn_plugin.models.hf import build_causal_lm  # noqa: E402
from ranks import finish  # noqa: E402


def pyramid(step, stage_layers: list[int]) -> None:
    """Give the step's micro-batches their own checkpointed layer counts, different on each stage
    (as a pyramid plan would): the engine must apply its own stage's entry."""
    step.plan = dataclasses.replace(
        step.plan,
        micro_batches=tuple(
            dataclasses.replace(desc, checkpointed=tuple((i + s) % (n + 1) for s, n in enumerate(stage_layers)))
            for i, desc in enumerate(step.plan.micro_batches)
        ),
    )


def record_pyramid(engine) -> list[tuple[int | None, int, int]]:
    """(planned count, layers running the micro-batch's mode, layers of the stage) each time the
    engine sets up a forward or a backward."""
    applied, set_recompute = [], engine._set_recompute

    def recording(mb: int) -> None:
        set_recompute(mb)
        counts = engine._step.plan.micro_batches[mb].checkpointed
        modes = recompute_switch(engine.module)._modes
        ran = len(modes) - modes.count("none")
        applied.append((counts[engine.stage_id] if counts else None, ran, len(modes)))

    engine._set_recompute = recording
    return applied


def count_split(engine, drop_weights: bool) -> list[int]:
    """Every BackwardInput and BackwardWeight the engine runs, as [I's, W's, W's with another
    micro-batch's pass between their I and them]; ``drop_weights``: the W's do nothing."""
    counts, handlers = [0, 0, 0], dict(engine._INSTRUCTION_MAP)
    for n, name in enumerate(("BackwardInput", "BackwardWeight")):
        cls = next(c for c in handlers if c.__name__ == name)

        def counted(self, ins, run=handlers[cls], n=n):
            counts[n] += 1
            if n == 1:
                counts[2] += deferred(self._step.plan.instructions, ins)
                if drop_weights:
                    return None
            return run(self, ins)

        handlers[cls] = counted
    engine._INSTRUCTION_MAP = handlers
    return counts


def deferred(instructions, weight) -> bool:
    """Whether another micro-batch's forward or backward runs between ``weight``'s I and it."""
    at = instructions.index(weight)
    start = next(
        n
        for n in range(at, -1, -1)
        if type(instructions[n]).__name__ == "BackwardInput" and instructions[n].mb == weight.mb
    )
    passes = ("ForwardPass", "BackwardPass", "BackwardInput")
    return any(type(i).__name__ in passes and i.mb != weight.mb for i in instructions[start:at])


def main():
    out = sys.argv[1]
    schedule = sys.argv[2] if len(sys.argv) > 2 else "auto"
    drop_weights = "--drop-weights" in sys.argv  # the test that a split without its W's is caught
    bf16 = "--bf16" in sys.argv  # DeepSpeed's bf16 optimizer: fp32 gradients taken after each backward and W
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    lengths, data = random_dataset(1)
    results = []
    # tied: the head is the embedding's weight, used on the first and the last stage (DeepSpeed's
    # tied layer: its gradients summed between them)
    for zero, layout, recompute, tied in (
        (1 if bf16 else 0, "padded", "none", False),  # bf16 under ZeRO-0 is refused on a pipeline
        (1, "packed", "full", False),
        (1, "packed", "none", True),
    ):
        torch.manual_seed(0)
        model = build_causal_lm({**MODEL, "num_hidden_layers": 3, "tie_word_embeddings": tied})
        ref = copy.deepcopy(model)
        config = {
            "zero_optimization": {"stage": zero},
            "zero_allow_untested_optimizer": True,
            **({"bf16": {"enabled": True}} if bf16 else {}),
            "dyn_plugin": {
                "microbatching": {"layout": layout, "global_tokens": 1500, "max_seq_len": 256, "recompute": recompute},
                "pipeline": {"stages": 2, "schedule": schedule},
                # a small device: the plan must cut the global batch into several micro-batches
                "cluster": {"device": {"memory_mb": {"none": 4, "full": 1.1}[recompute], "memory_fraction": 1.0}},
                "cost_model": {"kind": "analytic", "dtype": "bf16" if bf16 else "fp32"},
                # every stage's timed passes refit the model from the first step on (the analytic
                # model's nominal figures misprice this CPU): the second step is planned with it
                "calibration": {"warmup_steps": 0, "every": 1, "min_observations": 2},
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
        applied = record_pyramid(engine)
        split = count_split(engine, drop_weights)
        ids, shapes, batch_sizes = [], [], []
        for step in itertools.islice(loader, 2):  # through one engine: counts and shapes change between steps
            if recompute != "none":
                pyramid(step, [s.num_layers for s in loader.context.spec.stages])
            loss = deepspeed_ext.train_step(engine, step)
            shapes.append([mb.shape for mb in step.plan.micro_batches])
            batch_sizes.append(len(loader.context.batches(0)[step.index]))
            # every replica's samples, from its first stage (the last stage loads the same ones)
            mine = [i for mb in step.sample_ids for i in mb] if engine.is_first_stage() else []
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            step_ids = [i for g in gathered for i in g]
            reference(ref, [data[i]["input_ids"] for i in sorted(step_ids)], LR)
            ids += step_ids
            if len(shapes) == 1:
                first = step
        # DeepSpeed's pipeline checkpoint (per layer) plus the loader position round-trips
        ckpt = os.path.join(os.path.dirname(out), f"ckpt-{zero}")
        deepspeed_ext.save_checkpoint(engine, loader, ckpt)
        saved = [p.detach().clone() for p in engine.module.parameters()]
        with torch.no_grad():
            for p in engine.module.parameters():
                p.add_(1.0)
        next(iter(loader))  # moves the loader on; the checkpoint must move it back
        deepspeed_ext.load_checkpoint(engine, loader, ckpt)
        restored = max(float((p.detach() - q).abs().max()) for p, q in zip(engine.module.parameters(), saved))
        local = {id(p) for p in engine.module.parameters()}
        diffs = [
            float((p.detach() - q.detach()).abs().max())
            for (_, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())
            if id(p) in local
        ]
        everywhere = [None] * world
        dist.all_gather_object(everywhere, applied)
        applied = [a for rank in everywhere for a in rank]
        stats = torch.tensor([max(diffs), len(diffs), *split], dtype=torch.float64)
        both = [torch.zeros_like(stats) for _ in range(world)]
        dist.all_gather(both, stats)
        results.append(
            {
                "zero": zero,
                "layout": layout,
                "tied": tied,
                "max_abs_diff": max(float(s[0]) for s in both),
                "params_compared": sum(int(s[1]) for s in both),
                "params": len(list(model.parameters())),
                "samples": len(ids),
                "distinct": len(set(ids)),
                "global_batch": sum(batch_sizes),
                "micro_batches": len(first.plan.micro_batches),
                "sizes": [len(mb.sample_ids) for mb in first.plan.micro_batches],
                "shapes_changed": shapes[0] != shapes[1],
                # per forward and backward on every rank: (planned count, layers that recomputed, layers of the stage)
                "pyramid": applied,
                "loss": loss,
                "dp": engine.dp_world_size,
                "restored_diff": restored,
                "resume_step": loader.step,
                "recompute": recompute,
                "recompute_ran": recompute_switch(engine.module).mode,
                "split": [int(sum(s[2 + n] for s in both)) for n in range(3)],  # I's, W's, deferred W's: every rank
                "observed": [position for position, _ in loader.calibration.errors],
                "versions": [c.to_dict() for c in loader.context.calibrations],
            }
        )
    finish(results, out)


if __name__ == "__main__":
    main()
