"""The single-process token-mean reference the multi-rank exactness tests compare against
(no DeepSpeed import: the FSDP workers use it too)."""

import numpy as np
import torch
import torch.distributed as dist

MODEL = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
LR = 0.5


def reference(model, samples, lr):
    """Token-mean loss over every scored token of the global batch, in one process, each sample
    alone: a token sequence (a causal LM scores all but its first token) or an (input, target)
    pair (an encoder-decoder scores every target token)."""
    total, loss = 0, 0
    for s in samples:
        if isinstance(s, tuple):
            source, target = (torch.as_tensor(x).unsqueeze(0) for x in s)
            out = model(input_ids=source, labels=target, use_cache=False)
            scored = target.shape[1]
        else:
            ids = torch.as_tensor(s).unsqueeze(0)
            labels = ids.clone()
            labels[0, 0] = -100
            out = model(input_ids=ids, labels=labels, use_cache=False)
            scored = len(s) - 1
        loss, total = loss + out.loss * scored, total + scored
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


def global_samples(step, world: int) -> list[int]:
    """Dataset indices of a step's whole global batch: every rank's, all-gathered, sorted."""
    mine = torch.tensor([i for mb in step.sample_ids for i in mb] + [-1] * (64 - sum(map(len, step.sample_ids))))
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return sorted(int(i) for g in gathered for i in g if i >= 0)
