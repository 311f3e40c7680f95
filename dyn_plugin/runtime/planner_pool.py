"""Planning ahead: background planner processes publish each rank's plan through the store.

The host rank (data-parallel rank 0, pipeline stage 0) starts ``num_planners`` processes
(``python -m dyn_plugin.runtime.planner_worker``, so nothing is pickled: they read the planning
context and the store config as JSON files; a Redis password travels in their environment, never
on their command line). Planner k plans the global batches at run positions p with p % n == k
(epochs one after another; so every rank knows which planner owes a plan), at most ``prefetch``
batches ahead of the host's cursor, and publishes one payload per rank under
``plan/{position}/{dp_rank}-{pp_rank}``; each rank waits for its own key, reads it and deletes it.

Lifecycle: the processes stop when the pool is closed or garbage-collected (the loader writes
the pool's own stop key, ``stop/{random token}``, so a stop key left in the store by an earlier
run never stops this one's planners), and, because they ask the kernel for a signal when their
parent dies (and check it besides), when the trainer dies, even by SIGKILL.

Failure: planners only exit when told to, so a watcher thread treats any other exit as a
failure and hands ``on_failure`` the reason (exit code or signal, the last lines of the
planner's stderr) within ~0.1 s; the loader publishes it under ``ERROR_KEY`` for every rank, so
no rank waits for a plan that will never come (each plans its steps itself from then on). A
planner that stops without exiting (SIGSTOP, a frozen node) is noticed by the ranks when its
plan is late (``loader.local_plan_after_s``). A store that is down does not end a planner: it
retries until the store answers.

Expiry: a plan that waited longer than ``store.ttl_s`` (a long pause in training) or that a
restarted server lost is gone for good; each planner keeps ``progress_key`` fresh, so the
waiting rank sees its plan was published and re-plans that step itself (the loader). A server
that restarted without its data also lost the progress keys and the cursor: the host publishes
the cursor again at its next wait, and a planner that finds its ``canary_key`` gone (or lost the
store for a while) publishes again from the cursor on.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import weakref
from typing import Callable
from urllib.parse import unquote, urlsplit

logger = logging.getLogger(__name__)


def plan_key(position: int, dp_rank: int, pp_rank: int, replica: int = 0) -> str:
    """Where the plan of one (column, stage) cell waits for one of the ranks sharing it (its
    tensor-parallel ranks): one key per reader, since a reader deletes what it has read."""
    return f"plan/{position}/{dp_rank}-{pp_rank}-{replica}"


def progress_key(worker: int) -> str:
    """The last position planner ``worker`` published, kept alive while it lives: a rank whose plan
    is missing although every planner has passed its position knows the plan expired (or the
    server lost it) rather than being still on its way."""
    return f"progress/{worker}"


def canary_key(worker: int) -> str:
    """A key planner ``worker`` writes when it starts publishing from a cursor (and, rarely, to keep
    it alive), never beside a plan, so no write of its own in flight when a server restarts brings
    it back: gone means the server lost its data (the progress key, the next plan rewrites)."""
    return f"canary/{worker}"


CURSOR_KEY = "cursor"
ERROR_KEY = "planner-error"
STDERR_LINES = 20  # of a failed planner's stderr, in the error every rank raises
_WATCH_S = 0.1


class PlannerError(RuntimeError):
    """A planner process exited while the run still needed it."""


class PlannerPool:
    def __init__(
        self,
        context_json: str,
        store_json: str,
        *,
        num_planners: int,
        prefetch: int,
        start: int,
        world_size: int,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self._dir = tempfile.mkdtemp(prefix="dynplugin-planners-")  # 0700: only this user reads the files
        store_json, env = _without_password(store_json)
        path, store_path = os.path.join(self._dir, "context.json"), os.path.join(self._dir, "store.json")
        for file, text in ((path, context_json), (store_path, store_json)):
            with open(file, "w") as f:
                f.write(text)
        self.stop_key = f"stop/{secrets.token_hex(8)}"
        self.procs: list[subprocess.Popen] = []
        self._stderr: list[str] = []
        for k in range(num_planners):
            cmd = [
                sys.executable,
                "-m",
                "dyn_plugin.runtime.planner_worker",
                "--context",
                path,
                "--store",
                store_path,
                "--worker",
                str(k),
                "--workers",
                str(num_planners),
                "--prefetch",
                str(prefetch),
                "--start",
                str(start),
                "--parent",
                str(os.getpid()),
                "--world",
                str(world_size),
                "--stop-key",
                self.stop_key,
            ]
            # stderr to a file, not a pipe: nobody has to drain it, and its tail explains a failure
            self._stderr.append(os.path.join(self._dir, f"planner{k}.stderr"))
            with open(self._stderr[-1], "wb") as err:
                self.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=err, env=env))
        logger.info("started %d planner processes (pids %s)", num_planners, [p.pid for p in self.procs])
        self._closing = threading.Event()
        # the thread holds no reference to the pool, so the pool can still be garbage-collected
        threading.Thread(
            target=_watch,
            args=(list(self.procs), list(self._stderr), self._closing, on_failure),
            name="dynplugin-planner-watch",
            daemon=True,
        ).start()
        self._finalizer = weakref.finalize(self, _shutdown, list(self.procs), self._dir, self._closing)

    def stopping(self) -> None:
        """From now on planners exiting is expected (the loader is about to stop them)."""
        self._closing.set()

    def close(self) -> None:
        self._finalizer()


def _without_password(store_json: str) -> tuple[str, dict[str, str]]:
    """The store config with no password in its URL, and the planners' environment, which carries
    it instead (as ``$store.password_env``, which wins over the URL's anyway): a command line is
    readable by every user of the machine (``ps``), a process's environment only by its owner."""
    from ..config import StoreConfig, with_password

    cfg, env = StoreConfig.model_validate_json(store_json), dict(os.environ)
    password = urlsplit(cfg.url).password if cfg.url is not None else None
    if password is None:
        return store_json, env
    env.setdefault(cfg.password_env, unquote(password))
    return cfg.model_copy(update={"url": with_password(cfg.url, None)}).model_dump_json(exclude_unset=True), env


def describe_exit(k: int, proc: subprocess.Popen, stderr_path: str) -> str:
    """What ended planner ``k``: its exit code or signal and the last lines it wrote to stderr."""
    code = proc.returncode
    how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    try:
        with open(stderr_path, "rb") as f:
            tail = f.read().decode(errors="replace").strip().splitlines()[-STDERR_LINES:]
    except OSError:
        tail = []
    last = ("; its last stderr lines:\n  " + "\n  ".join(tail)) if tail else "; it wrote nothing to stderr"
    return f"planner process {k} (pid {proc.pid}) {how} while training still needed plans{last}"


def _watch(
    procs: list[subprocess.Popen], stderr: list[str], closing: threading.Event, on_failure: Callable[[str], None] | None
) -> None:
    while not closing.wait(_WATCH_S):
        for k, p in enumerate(procs):
            if p.poll() is not None and not closing.is_set():
                why = describe_exit(k, p, stderr[k])
                logger.error("%s", why)
                if on_failure is not None:
                    try:
                        on_failure(why)
                    except Exception:  # the store may be gone too; the host still raises it itself
                        logger.exception("could not publish the planner failure to the other ranks")
                return


def _shutdown(procs: list[subprocess.Popen], directory: str, closing: threading.Event) -> None:
    closing.set()
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.send_signal(signal.SIGCONT)  # a stopped planner (SIGSTOP) acts on SIGTERM only once continued
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))
    os.rmdir(directory)
