"""The gradient all-reduce, measured: ``measure_allreduce`` starts ``ranks`` local processes

    python -m dyn_plugin.profiling.collective --rank R --world N --port P --sizes ... --parent PID

that all-reduce fp32 buffers of a few sizes over gloo (CPU ranks) or NCCL (one GPU per rank);
rank 0 prints (bytes, ms) as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Sequence

import numpy as np


def measure_allreduce(ranks: int, sizes: Sequence[int], *, repeats: int = 5, threads: int | None = None,
                      timeout_s: float = 120, backend: str = "gloo") -> list[tuple[float, float]]:
    """(bytes, ms) of an fp32 all-reduce among ``ranks`` local processes on ``backend``, per size."""
    from ..child import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "dyn_plugin.profiling.collective", "--world", str(ranks), "--port", str(port),
           "--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats), "--parent", str(os.getpid()),
           "--backend", backend]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads or 1)}
    procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
             for r in range(ranks)]
    try:
        outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"all-reduce measurement failed: exit codes {[p.returncode for p in procs]}")
    return [tuple(pt) for pt in json.loads(outs[0].decode().strip().splitlines()[-1])]


def _rank_main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    from ..child import die_with_parent

    p = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--port", "--repeats", "--parent"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--sizes", required=True)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = p.parse_args(argv)
    die_with_parent(args.parent)
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", args.rank)
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world)
    points = []
    for nbytes in map(int, args.sizes.split(",")):
        t = torch.ones(max(nbytes // 4, 1), device=device)
        best = np.inf
        for i in range(args.repeats + 1):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            sync()  # NCCL returns once the collective is queued
            ms = (time.perf_counter() - t0) * 1e3
            best = min(best, ms) if i else best  # the first is a warm-up
        slowest = torch.tensor([best], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the step waits for the slowest rank
        points.append((float(t.numel() * 4), float(slowest)))
    if args.rank == 0:
        print(json.dumps(points), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())
