"""Collectives, measured: ``measure_collectives`` starts ``ranks`` local processes

    python -m dyn_plugin.profiling.collective --rank R --world N --port P --sizes JSON --parent PID

that run each requested collective on fp32 buffers of a few sizes over gloo (CPU ranks) or
NCCL (one GPU per rank); rank 0 prints {op: [(bytes, ms), ...]} as JSON. The ops:

- ``allreduce``: the gradient all-reduce of a step (update.py);
- ``allgather``: ``all_gather_into_tensor`` (``all_gather_single`` from torch 2.13) of a sharded buffer, sharded data parallelism's
  parameter gather; the bytes recorded are the whole gathered buffer per rank (each rank
  contributes 1/ranks of them), as update.py prices it;
- ``reducescatter``: ``reduce_scatter_tensor`` (``reduce_scatter_single``) of a buffer, sharded data parallelism's gradient
  reduction; the bytes recorded are the whole buffer each rank reduces (each keeps 1/ranks);
- ``alltoall``: ``all_to_all_single`` of a buffer of that many bytes per rank, Ulysses'
  collective (sequence_parallel.py);
- ``p2p``: one ring exchange: every rank sends a block of that many bytes to rank+1 while it
  receives one from rank-1, posted together (``batch_isend_irecv``) as ring attention does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Callable, Mapping, Sequence

import numpy as np

OPS = ("allreduce", "allgather", "reducescatter", "alltoall", "p2p")


def measure_collectives(
    ranks: int,
    sizes: Mapping[str, Sequence[int]],
    *,
    repeats: int = 5,
    threads: int | None = None,
    timeout_s: float = 120,
    backend: str = "gloo",
) -> dict[str, list[tuple[float, float]]]:
    """(bytes, ms) per size of each op in ``sizes`` (keys from ``OPS``) among ``ranks`` local
    processes on ``backend``; every op is measured in the same processes, one start-up for all."""
    from ..child import free_port

    unknown = set(sizes) - set(OPS)
    if unknown:
        raise ValueError(f"unknown collectives {sorted(unknown)}; measurable: {', '.join(OPS)}")
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "dyn_plugin.profiling.collective",
        "--world",
        str(ranks),
        "--port",
        str(port),
        "--sizes",
        json.dumps({op: [int(b) for b in s] for op, s in sizes.items()}),
        "--repeats",
        str(repeats),
        "--parent",
        str(os.getpid()),
        "--backend",
        backend,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads or 1)}
    procs = [
        subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
        for r in range(ranks)
    ]
    try:
        outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError(
            f"collective measurement ({', '.join(sizes)}) failed: exit codes {[p.returncode for p in procs]}"
        )
    measured = json.loads(outs[0].decode().strip().splitlines()[-1])
    return {op: [tuple(pt) for pt in points] for op, points in measured.items()}


def _collective(op: str, nbytes: int, rank: int, world: int, device) -> tuple[Callable[[], None], int]:
    """The collective to time on buffers of about ``nbytes``, and the bytes it really moves per rank."""
    import torch
    import torch.distributed as dist

    if op == "allreduce":
        t = torch.ones(max(nbytes // 4, 1), device=device)
        return lambda: dist.all_reduce(t), t.numel() * 4
    if op in ("allgather", "reducescatter"):
        n = max(nbytes // 4 // world, 1) * world  # the whole buffer: `world` equal shards
        whole, shard = torch.ones(n, device=device), torch.ones(n // world, device=device)
        # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (same collectives)
        if op == "allgather":
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            return lambda: gather(whole, shard), n * 4
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(shard, whole), n * 4
    if op == "alltoall":
        n = max(nbytes // 4 // world, 1) * world  # all_to_all_single splits the buffer evenly
        src, dst = torch.ones(n, device=device), torch.empty(n, device=device)
        return lambda: dist.all_to_all_single(dst, src), n * 4
    if op == "p2p":
        n = max(nbytes // 4, 1)
        send, recv = torch.ones(n, device=device), torch.empty(n, device=device)

        def exchange() -> None:
            # both posted before either waits: a rendezvous backend (NCCL) would deadlock on a blocking send
            ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()

        return exchange, n * 4
    raise ValueError(f"unknown collective {op!r}; measurable: {', '.join(OPS)}")


def _rank_main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    from ..child import die_with_parent

    p = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--port", "--repeats", "--parent"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--sizes", required=True, help="JSON: {op: [bytes, ...]}")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = p.parse_args(argv)
    die_with_parent(args.parent)
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", args.rank)
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.init_process_group(
        args.backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world
    )
    measured: dict[str, list[tuple[float, float]]] = {}
    for op, sizes in json.loads(args.sizes).items():
        measured[op] = []
        for nbytes in sizes:
            run, moved = _collective(op, int(nbytes), args.rank, args.world, device)
            best = np.inf
            for i in range(args.repeats + 1):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                run()
                sync()  # NCCL returns once the collective is queued
                ms = (time.perf_counter() - t0) * 1e3
                best = min(best, ms) if i else best  # the first is a warm-up
            slowest = torch.tensor([best], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the step waits for the slowest rank
            measured[op].append((float(moved), float(slowest)))
    if args.rank == 0:
        print(json.dumps(measured), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())
