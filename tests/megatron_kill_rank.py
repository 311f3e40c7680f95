"""What each rank of the Megatron kill tests keeps for tests/test_megatron_kills.py to judge: the
steps it trained (the consumed log) and the parameters it ended with. Imported by both workers
(megatron_core_kill_worker.py, megatron_lm_kill_worker.py) inside the ranks.

The consumed log (``consumed-RANK.jsonl`` in the run's folder) gets one line per step as it is
trained: Megatron's iteration, the loader's position of the step, this rank's sample ids and its
micro-batches (each one forward). A killed launch leaves lines for steps its checkpoint does not
hold; the next launch, once it knows the iteration its checkpoint restored, keeps only the lines
before it. The restored iteration comes from Megatron's own state (its checkpoint's counters), the
positions from the plugin's loader, so a loader restored to the wrong place shows as positions that
are not the iterations.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from dyn_plugin.atomic import atomic_path, write_atomic


def log_path(out: str, rank: int) -> str:
    return os.path.join(out, f"consumed-{rank}.jsonl")


def entries(path: str) -> list[dict]:
    """The log's lines; a last line torn by a kill is left out (its step was never checkpointed)."""
    if not os.path.exists(path):
        return []
    lines = []
    with open(path) as f:
        for line in f:
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return lines


def resume_log(out: str, rank: int, iteration: int) -> None:
    """This launch trains from ``iteration`` on: the lines of later steps went with the killed launch.
    Rewritten atomically: a kill here leaves the old log, which the next launch trims again."""
    path = log_path(out, rank)
    kept = [e for e in entries(path) if e["iteration"] < iteration]
    write_atomic(path, "".join(json.dumps(e) + "\n" for e in kept))


def log_step(out: str, rank: int, iteration: int, run: Any) -> None:
    """The step the plugin's run (``megatron_patches.runtime.RUN``) last handed out, trained as ``iteration``."""
    step = run.step
    position = run.loader.context.position(step.epoch, step.index)
    ids = [int(i) for mb in step.sample_ids for i in mb]
    line = {"iteration": iteration, "position": position, "ids": ids, "micro_batches": len(step.sample_ids)}
    with open(log_path(out, rank), "a") as f:
        f.write(json.dumps(line) + "\n")


def write_final(out: str, rank: int, model: Any, run: Any) -> None:
    """The parameters this rank ends with and the loader's position there (``final-RANK.pt``). A
    launch resumed from the last checkpoint trains nothing and never builds its loader: the
    restored position is its position."""
    from megatron_patches.runtime import unwrap

    position = run.loader.position if run.loader is not None else run.resume.position
    params = {name: p.detach().clone() for name, p in unwrap(model).named_parameters()}
    with atomic_path(os.path.join(out, f"final-{rank}.pt")) as tmp:
        torch.save({"position": position, "params": params}, tmp)
