"""DynLoader on 2 gloo ranks: agreement, exactly once, crash and resume, no orphan planners,
with no store, the embedded TCPStore and a real Redis server."""
import json
import os
import time

import pytest
from redis_server import redis_server  # noqa: F401  (fixture)

from ranks import free_port, run
from test_loader import make



def run_ranks(out, mode, store=None, env=None):
    codes, _ = run("dist_loader_worker.py", out, mode, env={"TEST_STORE": json.dumps(store or {"backend": "none"}),
                                                          **(env or {})}, timeout=120)
    return codes


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
    assert run_ranks(tmp_path, "full", store=store, env=env) == [0, 0]
    check_exactly_once(tmp_path, len(make()[2]))


@pytest.mark.parametrize("backend", ["none", "tcp"])
def test_crash_and_resume_gives_exactly_the_rest(tmp_path, backend):
    store = {"backend": "tcp", "port": free_port(), "namespace": "resume-test"} if backend == "tcp" else None
    codes = run_ranks(tmp_path, "stop-after:3", store=store)
    assert all(c == -9 for c in codes), codes  # both ranks died by SIGKILL mid-epoch
    pids = json.load(open(tmp_path / "pids0.json"))
    _assert_gone(pids)
    if store:
        store = {**store, "port": free_port()}
    assert run_ranks(tmp_path, "resume", store=store) == [0, 0]
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
