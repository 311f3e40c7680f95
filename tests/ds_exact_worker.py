"""One rank of the DeepSpeed exactness test: one planned step per ZeRO stage and layout,
compared with a single-process reference on the whole global batch (run as a script)."""

import copy
import dataclasses
import sys

import torch
import torch.distributed as dist

import deepspeed_ext

deepspeed_ext.skip_cpu_shm_build()

import deepspeed  # noqa: E402

from dyn_plugin.host.recompute import recompute_switch  # noqa: E402
from dyn_plugin.models.hf import build_causal_lm  # noqa: E402
from dyn_plugin.models.recompute import _attention, decoder_layers  # noqa: E402
from ranks import finish  # noqa: E402
from token_mean import (  # noqa: E402
    LR,
    MODEL,
    global_samples,
    random_dataset,  # noqa: F401 (also imported from here)
    reference,
)

PYRAMID = (1, 2, 1, 0)  # checkpointed layers of the mixed-mode step's micro-batches, in turn


def count_attention_calls(model) -> list[int]:
    """A counter of attention-block forwards, recomputes in backward included: patched on the
    class before the recompute switch wraps anything, so the checkpointed forwards call it too."""
    calls = [0]
    cls = type(_attention(decoder_layers(model)[0]))
    forward = cls.forward

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return forward(self, *args, **kwargs)

    cls.forward = counted
    return calls


def record_modes(engine, calls: list[int]) -> list[tuple[str, int | None, int]]:
    """(mode, layer count, attention calls so far) each time train_step switches to a micro-batch's mode."""
    switch = recompute_switch(engine.module)
    seen, set_mode = [], switch.set

    def recording(mode: str, layers: int | None = None) -> None:
        seen.append((mode, layers, calls[0]))
        set_mode(mode, layers)

    switch.set = recording
    return seen


def run_case(stage: int, layout: str, recompute: str, data, lengths, world: int, modes: tuple[str, ...] = ()) -> dict:
    """One planned step against the reference. ``modes`` overrides the plan's recompute mode of
    this rank's micro-batches in turn, and ``PYRAMID`` their checkpointed layer counts: one step
    that switches modes and counts between its micro-batches."""
    torch.manual_seed(0)
    model = build_causal_lm(MODEL)
    ref = copy.deepcopy(model)
    calls = count_attention_calls(model) if modes else None
    config = {
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "dyn_plugin": {
            "microbatching": {"layout": layout, "global_tokens": 1500, "max_seq_len": 256, "recompute": recompute},
            # a small device: the plan must cut the global batch into several micro-batches
            "cluster": {
                "device": {"memory_mb": {"none": 2, "selective": 1.6, "full": 1.0}[recompute], "memory_fraction": 1.0}
            },
            "cost_model": {"kind": "analytic", "dtype": "fp32"},
        },
    }
    engine, _, loader, _ = deepspeed_ext.initialize(
        model=model,
        config=config,
        dataset=data,
        lengths=lengths,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        seed=3,
    )
    step = next(iter(loader))
    result = {}
    if modes:
        planned = list(step.plan.micro_batches)  # frozen: the step gets a plan with these modes
        for i, m in enumerate(step.plan.loads):
            planned[m] = dataclasses.replace(
                planned[m], recompute=modes[i % len(modes)], checkpointed=(PYRAMID[i % len(PYRAMID)],)
            )  # one stage
        step.plan = dataclasses.replace(step.plan, micro_batches=tuple(planned))
        seen = record_modes(engine, calls)
    deepspeed_ext.train_step(engine, step)
    if modes:
        # attention forwards per micro-batch: once per layer, twice where backward recomputes it
        marks = [c for _, _, c in seen] + [calls[0]]
        result = {
            "planned_modes": [d.recompute for d in step.loaded],
            "modes_ran": [m for m, _, _ in seen],
            "planned_counts": [d.checkpointed[0] for d in step.loaded],
            "counts_ran": [n for _, n, _ in seen],
            "attention_calls": [b - a for a, b in zip(marks, marks[1:])],
            "layers": MODEL["num_hidden_layers"],
        }
    ids = global_samples(step, world)
    reference(ref, [data[i]["input_ids"] for i in ids], LR)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        diff = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(params, ref.parameters()))
    sizes = [len(s) for s in step.sample_ids]
    engine.destroy() if hasattr(engine, "destroy") else None
    return {
        "stage": stage,
        "layout": layout,
        "max_abs_diff": diff,
        "micro_batch_sizes": sizes,
        "recompute": recompute,
        "recompute_ran": recompute_switch(engine.module).mode,
        "samples": len(ids),
        **result,
    }


def main():
    out = sys.argv[1]
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    lengths, data = random_dataset(0)
    results = []
    for stage in (0, 1, 2, 3):
        recompute = ("none", "full", "none", "selective")[stage]  # the plan's mode, applied per micro-batch
        for layout in ("padded", "packed"):
            results.append(run_case(stage, layout, recompute, data, lengths, world))
    mixed = run_case(1, "packed", "none", data, lengths, world, modes=("full", "none", "selective"))
    finish({"cases": results, "mixed": mixed}, out)


if __name__ == "__main__":
    main()
