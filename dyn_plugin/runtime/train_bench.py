"""What the side-by-side training benchmarks share (deepspeed_ext/compare.py, DeepSpeed's
batchings; fsdp/compare.py, the sharding plans): real token ids, and the cost model that prices
their plans.

Token ids: a bundled corpus tokenized with the plugin's offline BPE. Rank 0 tokenizes
(documents truncated to ``max_len`` tokens) and writes an npz (no pickle); every rank then reads
the same file, so all ranks train on identical ids.
"""
from __future__ import annotations

import os

import numpy as np
import torch.distributed as dist


def tokenized_corpus(name: str, max_len: int, out: str) -> tuple[list[np.ndarray], np.ndarray]:
    """The documents of corpus ``name`` (code, prose or mixture) as token ids of at most ``max_len``
    tokens (one-token documents dropped: nothing to predict), and their lengths; cached in ``out``."""
    path = os.path.join(out, f"{name}-{max_len}-tokens.npz")  # the cap is part of the key: ids differ per cap
    if dist.get_rank() == 0 and not os.path.exists(path):
        from ..lengths.corpus import iter_documents
        from ..lengths.tokenizer import get_tokenizer

        ids = [np.asarray(e.ids[:max_len], dtype=np.int32) for e in get_tokenizer().encode_batch(list(iter_documents(name)))]
        ids = [x for x in ids if len(x) > 1]
        np.savez(path, flat=np.concatenate(ids), offsets=np.cumsum([0] + [len(x) for x in ids]))
    dist.barrier()
    z = np.load(path)
    flat, off = z["flat"], z["offsets"]
    docs = [flat[a:b] for a, b in zip(off[:-1], off[1:])]
    return docs, np.array([len(d) for d in docs])


def cost_model_section(profile: str | None, dtype: str) -> dict:
    """The measured profile when given, else the analytic model of the live model's shape
    (predicted times then come from nominal device figures, not this machine's)."""
    if profile:
        return {"kind": "profile", "profile": profile, "dtype": dtype}
    return {"kind": "analytic", "dtype": dtype}


def cost_model_label(profile: str | None) -> str:
    """Which cost model priced the plans, for the reports and the JSON rows."""
    return f"profile {profile}" if profile else "analytic (no --profile: predictions from nominal device figures)"
