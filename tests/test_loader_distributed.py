"""DynLoader on 2 gloo ranks: agreement, exactly once, crash and resume, no orphan planners,
with no store, the embedded TCPStore and a real Redis server."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest
from redis_server import redis_server  # noqa: F401  (fixture)

from test_loader import make

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "dist_loader_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out, mode, world=2, store=None, env_extra=None):
    port = free_port()
    procs = []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "TEST_STORE": json.dumps(store or {"backend": "none"}), **(env_extra or {})}
        procs.append(subprocess.Popen([sys.executable, WORKER, str(out), mode], env=env, cwd=os.path.dirname(HERE)))
    return procs


def wait_all(procs, timeout=120):
    return [p.wait(timeout=timeout) for p in procs]


def consumed(out, world=2):
    steps = {}
    for r in range(world):
        for line in open(out / f"rank{r}.jsonl"):
            rec = json.loads(line)
            steps.setdefault(rec["step"], {})[r] = rec
    return steps


def check_exactly_once(out, n_samples, world=2):
    steps = consumed(out, world)
    samples = [i for recs in steps.values() for rec in recs.values() for i in rec["samples"]]
    assert sorted(samples) == list(range(n_samples))
    for recs in steps.values():
        assert len({rec["digest"] for rec in recs.values()}) == 1



@pytest.mark.parametrize("backend", ["none", "tcp", "redis"])
def test_two_ranks_agree_and_consume_every_sample_once(tmp_path, backend, request):
    store, env = None, {}
    if backend == "tcp":
        store = {"backend": "tcp", "port": free_port(), "namespace": "dist-test"}
    elif backend == "redis":
        server = request.getfixturevalue("redis_server")
        store = {"backend": "redis", "url": server.url, "namespace": f"dist-{time.time_ns()}"}
        env = {"DYN_PLUGIN_REDIS_PASSWORD": server.password}
    assert wait_all(launch(tmp_path, "full", store=store, env_extra=env)) == [0, 0]
    check_exactly_once(tmp_path, len(make()[2]))


@pytest.mark.parametrize("backend", ["none", "tcp"])
def test_crash_and_resume_gives_exactly_the_rest(tmp_path, backend):
    store = {"backend": "tcp", "port": free_port(), "namespace": "resume-test"} if backend == "tcp" else None
    codes = wait_all(launch(tmp_path, "stop-after:3", store=store))
    assert all(c == -9 for c in codes), codes  # both ranks died by SIGKILL mid-epoch
    pids = json.load(open(tmp_path / "pids0.json"))
    _assert_gone(pids)
    if store:
        store = {**store, "port": free_port()}
    assert wait_all(launch(tmp_path, "resume", store=store)) == [0, 0]
    check_exactly_once(tmp_path, len(make()[2]))


def _assert_gone(pids, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline and any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in pids):
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in pids), "planner processes outlived the trainer"


def _state(pid) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().split(")")[1].split()[0]
    except OSError:
        return "Z"
