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

from dyn_plugin.models.hf import build_causal_lm  # noqa: E402
from ranks import finish  # noqa: E402

MODEL = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=512, tie_word_embeddings=False)
LR = 0.5


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


def main():
    out = sys.argv[1]
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    lengths, data = random_dataset(0)
    results = []
    for stage in (0, 1, 2, 3):
        recompute = ("none", "full", "none", "selective")[stage]  # the plan's mode, applied per micro-batch
        for layout in ("padded", "packed"):
            torch.manual_seed(0)
            model = build_causal_lm(MODEL)
            ref = copy.deepcopy(model)
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
            deepspeed_ext.train_step(engine, step)
            mine = torch.tensor([i for mb in step.sample_ids for i in mb] + [-1] * (64 - sum(map(len, step.sample_ids))))
            gathered = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine)
            ids = sorted(int(i) for g in gathered for i in g if i >= 0)
            reference(ref, [data[i]["input_ids"] for i in ids], LR)
            params = list(engine.module.parameters())
            with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
                diff = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(params, ref.parameters()))
            sizes = [len(s) for s in step.sample_ids]
            results.append({"stage": stage, "layout": layout, "max_abs_diff": diff, "micro_batch_sizes": sizes,
                            "recompute": recompute, "recompute_ran": engine._dyn_plugin_recompute.mode,
                            "samples": len(ids)})
            engine.destroy() if hasattr(engine, "destroy") else None
    finish(results, out)


if __name__ == "__main__":
    main()
