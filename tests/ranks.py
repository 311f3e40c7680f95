"""Launch a script as a few local gloo ranks (env rendezvous), for the multi-process tests."""

import os
import subprocess
import sys

from dyn_plugin.child import free_port  # also imported from here by the tests

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(
    script: str, *args, world: int = 2, env: dict | None = None, capture: bool = False
) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for r in range(world):
        rank_env = {
            **os.environ,
            "RANK": str(r),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        out = subprocess.PIPE if capture else None
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.join(HERE, script), *map(str, args)],
                env=rank_env,
                cwd=os.path.dirname(HERE),
                stdout=out,
                stderr=subprocess.STDOUT if capture else None,
            )
        )
    return procs


def run(
    script: str, *args, world: int = 2, env: dict | None = None, timeout: float = 300
) -> tuple[list[int], list[str]]:
    """Exit codes and combined output of every rank."""
    procs = launch(script, *args, world=world, env=env, capture=True)
    logs = [p.communicate(timeout=timeout)[0].decode(errors="replace") for p in procs]
    return [p.returncode for p in procs], logs


def finish(results, out) -> None:
    """End a DeepSpeed rank script: rank 0 writes the results as JSON, then every rank leaves
    without DeepSpeed's exit handlers, which sometimes abort on CPU."""
    import json

    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)
