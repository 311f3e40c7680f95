"""One rank of the DeepSpeed kill tests (run as a script): train one epoch on a path (ZeRO 0-3, a
two-stage pipeline, sequence parallelism), checkpointing every other step, resumed from the newest
whole checkpoint at each launch and killed where ``KILL`` says (tests/kill_harness.py).

The checkpoint's client state carries the consumed log (each step's position and every sample it
trained, gathered from every replica), so a resumed launch holds the history of the steps its
checkpoint holds and nothing of the lost ones. At the end rank 0 writes the log and the full
parameters (gathered from ZeRO-3's shards, from both pipeline stages) to ``final.pt``.
"""

import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import deepspeed_ext  # noqa: E402

deepspeed_ext.skip_cpu_shm_build()

import deepspeed  # noqa: E402

from dyn_plugin.models.hf import build_causal_lm  # noqa: E402
from kill_harness import KillSwitch  # noqa: E402
from token_mean import MODEL  # noqa: E402

SAMPLES = 90
SAVE_EVERY = 2
PATHS = {
    "zero0": {"zero": 0},
    # planned ahead by a planner process through the TCP store: its kills are drawn too
    "zero1": {"zero": 1, "plugin": {"store": {"backend": "tcp"}, "loader": {"planners": 1, "prefetch": 2}}},
    "zero2": {"zero": 2},
    "zero3": {"zero": 3},
    # a split-backward pipeline (zero-bubble plans): a kill may fall between an I and its W
    "pipe": {"zero": 1, "plugin": {"pipeline": {"stages": 2, "schedule": "zero_bubble"}}},
    "sp": {"zero": 1, "plugin": {"sequence_parallel": {"enabled": True, "sizes": [1, 2], "attention": "auto"}}},
}


def dataset() -> tuple[np.ndarray, list[dict]]:
    rng = np.random.default_rng(7)
    lengths = rng.integers(2, 200, size=SAMPLES)
    return lengths, [{"input_ids": rng.integers(0, 97, size=int(n))} for n in lengths]


def trained_samples(engine, step) -> list[int]:
    """The samples this rank fed the model whole or as shard 0 (sequence parallelism splits one
    sample over a group; a pipeline's last stage reads the same samples as its first)."""
    if hasattr(engine, "is_first_stage") and not engine.is_first_stage():
        return []
    if step.shards:
        return [i for (_, _, index), ids in zip(step.shards, step.sample_ids) if index == 0 for i in ids]
    return [i for mb in step.sample_ids for i in mb]


def full_parameters(engine) -> torch.Tensor | None:
    """Every parameter, on rank 0 (None elsewhere): ZeRO-3's shards gathered, pipeline stages joined."""
    params = list(engine.module.parameters())
    if getattr(engine, "zero_optimization_stage", lambda: 0)() == 3:
        with deepspeed.zero.GatheredParameters(params):
            mine = torch.cat([p.detach().flatten().clone() for p in params])
    else:
        mine = torch.cat([p.detach().flatten() for p in params])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine if dist.get_rank() in _holders(engine) else None)
    return torch.cat([t for t in every if t is not None]) if dist.get_rank() == 0 else None


def _holders(engine) -> set[int]:
    """The ranks whose parameters make the whole model once: column 0 of each pipeline stage, else rank 0."""
    if hasattr(engine, "is_first_stage"):
        grid = engine.grid
        return {grid.stage_to_global(s, data=0) for s in range(grid.pipe_parallel_size)}
    return {0}


def main() -> None:
    out, path = sys.argv[1], sys.argv[2]
    spec = PATHS[path]
    switch = KillSwitch(int(os.environ["RANK"]))
    switch.arm_saves()
    deepspeed.init_distributed(dist_backend="gloo")
    lengths, data = dataset()
    torch.manual_seed(0)
    model = build_causal_lm({**MODEL, "num_hidden_layers": 3} if path == "pipe" else MODEL)
    config = {
        "zero_optimization": {"stage": spec["zero"]},
        "zero_allow_untested_optimizer": True,
        "dyn_plugin": {
            "microbatching": {"global_tokens": 1200, "max_seq_len": 256},
            "cost_model": {"kind": "analytic", "dtype": "fp32"},
            # a small device: steps cut into several micro-batches, so a kill can fall between them
            "cluster": {"device": {"memory_mb": 0.8, "memory_fraction": 1.0}},
            # bit for bit against the uninterrupted run: plans from the profile alone, not from timings
            "calibration": {"enabled": False},
            **spec.get("plugin", {}),
        },
    }
    if "store" in config["dyn_plugin"]:  # a port of this launch's own (MASTER_PORT + 1 may be taken)
        config["dyn_plugin"]["store"] = {"backend": "tcp", "port": int(os.environ["STORE_PORT"])}
    engine, _, loader, _ = deepspeed_ext.initialize(
        model=model,
        config=config,
        dataset=data,
        lengths=lengths,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        seed=5,
    )
    switch.arm_model(engine.module)
    switch.arm_planners(loader)
    ckpt = os.path.join(out, "ckpt")
    consumed: list = []
    try:
        _, client = deepspeed_ext.load_checkpoint(engine, loader, ckpt)
        consumed = client["consumed"]
    except FileNotFoundError:
        pass  # the first launch
    switch.hit("startup")
    for step in loader:
        deepspeed_ext.train_step(engine, step)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, trained_samples(engine, step))
        consumed.append([loader.position - 1, sorted(i for ids in every for i in ids)])
        if loader.step % SAVE_EVERY == 0:
            with switch.saving():
                deepspeed_ext.save_checkpoint(engine, loader, ckpt, client_state={"consumed": consumed})
    params = full_parameters(engine)
    print(f"rank {dist.get_rank()} events this launch: {switch.counts}", flush=True)
    if dist.get_rank() == 0:
        torch.save({"params": params, "consumed": consumed}, os.path.join(out, "final.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
