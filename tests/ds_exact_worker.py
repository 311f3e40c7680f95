"""One rank of the DeepSpeed exactness test: one planned step per ZeRO stage and layout,
compared with a single-process reference on the whole global batch (run as a script)."""
import copy
import sys

import numpy as np
import torch
import torch.distributed as dist

import deepspeed_ext

deepspeed_ext.skip_cpu_shm_build()

import deepspeed  # noqa: E402
from ranks import finish  # noqa: E402

from dyn_plugin.models.hf import build_causal_lm  # noqa: E402
from dyn_plugin.models.recompute import _attention, decoder_layers  # noqa: E402

MODEL = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=512, tie_word_embeddings=False)
LR = 0.5
PYRAMID = (1, 2, 1, 0)  # checkpointed layers of the mixed-mode step's micro-batches, in turn


def reference(model, samples, lr):
    """Token-mean loss over every scored token of the global batch, in one process."""
    total = sum(len(s) - 1 for s in samples)
    loss = 0
    for s in samples:
        ids = torch.as_tensor(s).unsqueeze(0)
        labels = ids.clone()
        labels[0, 0] = -100
        out = model(input_ids=ids, labels=labels, use_cache=False)
        loss = loss + out.loss * (len(s) - 1)
    (loss / total).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None


def random_dataset(seed: int):
    """40 sequences of 2-200 random token ids: (lengths, dataset)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 200, size=40)
    return lengths, [{"input_ids": rng.integers(0, 97, size=int(n))} for n in lengths]


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
    switch = deepspeed_ext._recompute_switch(engine)
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
        "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
        "dyn_plugin": {
            "microbatching": {"layout": layout, "global_tokens": 1500, "max_seq_len": 256, "recompute": recompute},
            # a small device: the plan must cut the global batch into several micro-batches
            "cluster": {"device": {"memory_mb": {"none": 2, "selective": 1.6, "full": 1.0}[recompute], "memory_fraction": 1.0}},
            "cost_model": {"kind": "analytic", "dtype": "fp32"},
        },
    }
    engine, _, loader, _ = deepspeed_ext.initialize(
        model=model, config=config, dataset=data, lengths=lengths,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR), seed=3)
    step = next(iter(loader))
    result = {}
    if modes:
        for i, desc in enumerate(step.loaded):
            desc["recompute"] = modes[i % len(modes)]
            desc["checkpointed"] = (PYRAMID[i % len(PYRAMID)],)  # one stage
        seen = record_modes(engine, calls)
    deepspeed_ext.train_step(engine, step)
    if modes:
        # attention forwards per micro-batch: once per layer, twice where backward recomputes it
        marks = [c for _, _, c in seen] + [calls[0]]
        result = {"planned_modes": [d["recompute"] for d in step.loaded], "modes_ran": [m for m, _, _ in seen],
                  "planned_counts": [d["checkpointed"][0] for d in step.loaded], "counts_ran": [n for _, n, _ in seen],
                  "attention_calls": [b - a for a, b in zip(marks, marks[1:])], "layers": MODEL["num_hidden_layers"]}
    mine = torch.tensor([i for mb in step.sample_ids for i in mb] + [-1] * (64 - sum(map(len, step.sample_ids))))
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    ids = sorted(int(i) for g in gathered for i in g if i >= 0)
    reference(ref, [data[i]["input_ids"] for i in ids], LR)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        diff = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(params, ref.parameters()))
    sizes = [len(s) for s in step.sample_ids]
    engine.destroy() if hasattr(engine, "destroy") else None
    return {"stage": stage, "layout": layout, "max_abs_diff": diff, "micro_batch_sizes": sizes,
            "recompute": recompute, "recompute_ran": engine._dyn_plugin_recompute.mode, "samples": len(ids), **result}


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
