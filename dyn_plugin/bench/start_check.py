"""``dynplugin bench start-check``: what the start-up check (``dyn_plugin.host.exactness``) costs a run.

A Llama of about 1.1B parameters (TinyLlama-1.1B's shape: width 2048, 22 layers, 32 query and 4
key/value heads, MLP 5632, vocabulary 32000), randomly initialised in ``--dtype`` on this machine's
CPU, is checked as each host checks it before its first step (one probe: the documents alone
computed once for the packed and padded checks); each host's time is the fastest of ``--repeats``. Per host: DeepSpeed and FSDP data parallel run the packed- and padded-row checks,
DeepSpeed with sequence parallelism also the shards, a DeepSpeed pipeline also its stages.
"""

from __future__ import annotations

import argparse
import time
from typing import get_args

from ..cli_args import count
from ..config import Precision

LLAMA_1B = dict(
    model_type="llama",
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
)
HOSTS = {
    "deepspeed": ("packed", "padded"),
    "deepspeed, sequence parallel": ("packed", "padded", "sharded"),
    "deepspeed, pipeline": ("packed", "padded", "stages"),
    "fsdp": ("packed", "padded"),
}


HELP = (
    "the start-up check's cost per host (packed and padded rows, sequence shards, pipeline stages) on a "
    "1.1B-parameter Llama on this CPU"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype", choices=get_args(Precision), default="fp32", help="the model's precision (default fp32)"
    )
    parser.add_argument(
        "--repeats", type=count(1, 100), default=3, help="timed rounds of each check; the fastest is kept"
    )


def run(args: argparse.Namespace) -> list[dict]:
    return [bench_start_check(args)]


def bench_start_check(args: argparse.Namespace) -> dict:
    import torch

    from deepspeed_ext.pipe_module import stage_difference

    from ..host import exactness
    from ..models.hf import build_causal_lm

    torch.manual_seed(0)
    from ..device import DTYPES

    model = build_causal_lm(LLAMA_1B).to(DTYPES[args.dtype])
    half = LLAMA_1B["num_hidden_layers"] // 2
    checks = {
        "packed": exactness.packed_difference,
        "padded": exactness.padded_difference,
        "sharded": exactness.sharded_difference,
        "stages": lambda m, probe: stage_difference(m, [half, LLAMA_1B["num_hidden_layers"] - half]),
    }
    hosts, found = {}, {}
    for host, used in HOSTS.items():
        rounds = []
        for _ in range(args.repeats):  # as a host runs them: one probe, the documents alone computed once
            probe, spent = exactness.Probe(model), {}
            for name in used:
                start = time.perf_counter()
                found[name] = checks[name](model, probe)
                spent[name] = (time.perf_counter() - start) * 1e3
            rounds.append(spent)
        best = min(rounds, key=lambda r: sum(r.values()))
        hosts[host] = {"total_ms": round(sum(best.values()), 1), **{k: round(v, 1) for k, v in best.items()}}
    return {
        "benchmark": "start-check",
        "model": "llama-1.1b",
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "hosts": hosts,
        "found": {k: None if v is None else str(v) for k, v in found.items()},
    }
