"""Planning ahead: background planner processes publish each rank's plan through the store.

The host rank (data-parallel rank 0, pipeline stage 0) starts ``num_planners`` processes
(``python -m dyn_plugin.runtime.planner_worker``, so nothing is pickled: they read the planning
context as JSON). Planner k plans global batches k, k+n, k+2n, ... of the run (epochs one after
another), at most ``prefetch`` batches ahead of the host's cursor, and publishes one payload per
rank under ``plan/{position}/{dp_rank}-{pp_rank}``; each rank waits for its own key, reads it and
deletes it.

Lifecycle: the processes stop when the pool is closed or garbage-collected, and, because they
ask the kernel for a signal when their parent dies (and check it besides), when the trainer
dies, even by SIGKILL.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import weakref

logger = logging.getLogger(__name__)


def plan_key(position: int, dp_rank: int, pp_rank: int) -> str:
    return f"plan/{position}/{dp_rank}-{pp_rank}"


CURSOR_KEY = "cursor"
STOP_KEY = "stop"


class PlannerPool:
    def __init__(self, context_json: str, store_json: str, *, num_planners: int, prefetch: int, start: int,
                 world_size: int) -> None:
        self._dir = tempfile.mkdtemp(prefix="dynplugin-planners-")
        path = os.path.join(self._dir, "context.json")
        with open(path, "w") as f:
            f.write(context_json)
        self.procs: list[subprocess.Popen] = []
        for k in range(num_planners):
            cmd = [sys.executable, "-m", "dyn_plugin.runtime.planner_worker", "--context", path, "--store", store_json,
                   "--worker", str(k), "--workers", str(num_planners), "--prefetch", str(prefetch),
                   "--start", str(start), "--parent", str(os.getpid()), "--world", str(world_size)]
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
        logger.info("started %d planner processes (pids %s)", num_planners, [p.pid for p in self.procs])
        self._finalizer = weakref.finalize(self, _shutdown, list(self.procs), self._dir)

    def failed(self) -> str | None:
        """A planner that exited with an error, described; None while all run."""
        for p in self.procs:
            if p.poll() not in (None, 0):
                return f"planner process {p.pid} exited with code {p.returncode}"
        return None

    def close(self) -> None:
        self._finalizer()


def _shutdown(procs: list[subprocess.Popen], directory: str) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))
    os.rmdir(directory)
