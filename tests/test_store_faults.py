"""Faults of the plan store and the planners under real training (2 gloo ranks, store_fault_worker.py):
Redis killed and restarted without its data, Redis killed for good, a planner stopped (SIGSTOP) or
killed (SIGKILL). Training either finishes with every sample once and the parameters of an
uninterrupted run (a plan the planners cannot give is planned on the rank: the same plan), or every
rank fails at the same step with one clear error, in a bounded time; never a hang."""

import json
import os
import re
import signal
import time

import pytest
import torch

from dyn_plugin.config import LoaderConfig
from dyn_plugin.runtime.loader import DynLoader
from dyn_plugin.runtime.planner_pool import plan_key
from dyn_plugin.store import StoreUnavailable
from kill_worker import SEED
from ranks import free_port, launch, run
from test_loader import make
from test_random_kills import uninterrupted

PASSWORD_ENV = "DYN_PLUGIN_REDIS_PASSWORD"
# store operations give up quickly on a dead server, so the tests' bounds can be tight
FAST_REDIS = {"timeout_s": 1.0, "retries": 2, "retry_backoff_s": 0.05}
DOWN = "planning on this rank while it is down"
LATE = "has not published it after"
FAILED = "planning on this rank each step whose plan is not in the store already"


def redis_store(server, **over) -> dict:
    return {"backend": "redis", "url": server.url, "namespace": "faults", **FAST_REDIS, **over}


def env_for(store: dict, loader: dict, server=None, **env) -> dict:
    out = {"TEST_STORE": json.dumps(store), "TEST_LOADER": json.dumps(loader), **env}
    if server is not None:
        out[PASSWORD_ENV] = server.password
    return {k: str(v) for k, v in out.items()}


def wait_for_step(out, step: int, procs, timeout: float = 60) -> None:
    """Until rank 0 has trained ``step`` steps (the ranks must not have exited before)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = out / "steps"
        if path.exists() and path.read_text() and int(path.read_text()) >= step:
            return
        assert all(p.poll() is None for p in procs), "a rank exited before the fault"
        time.sleep(0.01)
    raise AssertionError(f"rank 0 did not reach step {step} in {timeout} s")


def collect(procs, timeout: float = 60) -> tuple[list[int], list[str], list[float]]:
    """Exit codes, output and exit time (time.monotonic) of every rank."""
    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(ended) < len(procs) and time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = time.monotonic()
        time.sleep(0.02)
    for p in procs:
        if p.poll() is None:
            p.kill()
    logs = [p.communicate()[0].decode(errors="replace") for p in procs]
    assert len(ended) == len(procs), f"rank(s) still running after {timeout} s (a hang):\n" + "\n".join(logs)
    return [p.returncode for p in procs], logs, [ended[r] for r in range(len(procs))]


def check_result(out, epochs: int) -> list[dict]:
    """Every sample once per epoch, both ranks' parameters equal an uninterrupted run's, bit for bit."""
    finals = [json.loads((out / f"final{r}.json").read_text()) for r in range(2)]
    n = len(make()[2])
    samples = [i for f in finals for step in f["consumed"] for i in step]
    assert sorted(samples) == sorted(list(range(n)) * epochs), "samples lost or repeated"
    assert finals[0]["params"] == finals[1]["params"]
    assert torch.equal(torch.tensor(finals[0]["params"], dtype=torch.float64), uninterrupted(epochs))
    return finals


@pytest.mark.parametrize("outage_s", [0, 1.5])
def test_redis_restarted_without_its_data_mid_epoch_loses_nothing(tmp_path, fresh_redis_server, outage_s):
    """The server dies and comes back empty, every plan fetched ahead lost. At once, between two
    steps (0): no rank sees it down, the planner finds its progress key gone and publishes again from
    the cursor. For 1.5 s: the ranks plan locally while it is down, then read the planner's plans
    again. Either way no rank plans a lost plan itself, and no step waits for the late-plan fallback
    (10 s here)."""
    loader = {"planners": 1, "prefetch": 3, "plan_timeout_s": 30, "local_plan_after_s": 10}
    pause, epochs = (0.5, 1) if outage_s == 0 else (0.1, 2)
    env = env_for(redis_store(fresh_redis_server), loader, fresh_redis_server, EPOCHS=epochs, STEP_S=pause)
    procs = launch("store_fault_worker.py", tmp_path, env=env, capture=True)
    wait_for_step(tmp_path, 4, procs)
    fresh_redis_server.kill()
    time.sleep(outage_s)
    fresh_redis_server.restart()
    codes, logs, _ = collect(procs)
    assert codes == [0, 0], "\n".join(logs)
    finals = check_result(tmp_path, epochs=epochs)
    for log, final in zip(logs, finals):
        assert log.count(DOWN) == (1 if outage_s else 0), log  # one warning per outage a rank saw
        assert ("answers again after" in log) == bool(outage_s), log
        assert "was published but is gone" not in log, log  # the planner published them again
        assert max(final["plan_wait_s"][1:]) < 5, (final["plan_wait_s"], log)  # the first: planner start-up


def test_redis_down_for_good_fails_every_rank_at_the_same_step(tmp_path, fresh_redis_server):
    """Killed and never back: the ranks ride it out on local plans for plan_timeout_s, then every rank
    raises the same error at the same step (one rank gave up, all saw it in the plan check), naming
    the store's URL without its password and the timeout."""
    timeout = 4.0
    url = f"redis://:{fresh_redis_server.password}@127.0.0.1:{fresh_redis_server.port}/0"
    store = redis_store(fresh_redis_server, url=url)
    loader = {"planners": 1, "prefetch": 2, "plan_timeout_s": timeout}
    env = env_for(store, loader, EPOCHS=20, STEP_S=0.1)
    procs = launch("store_fault_worker.py", tmp_path, env=env, capture=True)
    wait_for_step(tmp_path, 3, procs)
    fresh_redis_server.kill()
    killed = time.monotonic()
    codes, logs, ended = collect(procs)
    assert all(c != 0 for c in codes), "\n".join(logs)
    masked = f"redis://:***@127.0.0.1:{fresh_redis_server.port}/0"
    errors = []
    for log in logs:
        assert fresh_redis_server.password not in log
        assert log.count(DOWN) == 1, log
        lines = [line.partition("StoreUnavailable: ")[2] for line in log.splitlines() if "StoreUnavailable: " in line]
        # one error per rank, and no other (a collective the other rank left would end in a second one)
        assert len(lines) == 1 and log.count("Traceback (most recent call last)") == 1, log
        errors.append(lines[0])
    assert errors[0] == errors[1]  # the same step on both ranks
    assert f"the plan store at {masked} did not answer for loader.plan_timeout_s = 4 s" in errors[0]
    assert re.search(r"rank\(s\) \[[01, ]+\] gave up at epoch \d+ step \d+", errors[0])
    for t in ended:
        assert timeout <= t - killed < timeout + 6, [t - killed for t in ended]


def test_a_stopped_planner_is_planned_around(tmp_path, fresh_redis_server):
    """SIGSTOP: the plan is late by local_plan_after_s once, then every rank plans its steps itself
    without waiting on that planner again; the planner ends with the loader all the same."""
    loader = {"planners": 1, "prefetch": 2, "plan_timeout_s": 30, "local_plan_after_s": 1.5}
    env = env_for(redis_store(fresh_redis_server), loader, fresh_redis_server, FAULT="sigstop", FAULT_AT=3)
    t0 = time.monotonic()
    codes, logs = run("store_fault_worker.py", tmp_path, env=env, timeout=60)
    assert codes == [0, 0], "\n".join(logs)
    assert time.monotonic() - t0 < 25  # nowhere near plan_timeout_s, let alone a step each
    finals = check_result(tmp_path, epochs=1)
    for log, final in zip(logs, finals):
        assert log.count(LATE) == 1, log
        waits = sorted(final["plan_wait_s"][1:])  # the first: planner start-up
        assert 1.5 <= waits[-1] < 5 and waits[-2] < 1.0, final["plan_wait_s"]  # late once, never waited on again
    planner = int((tmp_path / "planner.pid").read_text())
    assert not os.path.exists(f"/proc/{planner}"), "the stopped planner outlived the loader"


def test_a_killed_planner_is_planned_around_at_once(tmp_path):
    """SIGKILL (the TCP store this time): the host's watcher publishes the death, every rank reads it
    the first time its plan is missing and plans every step the planner no longer gives, with no wait."""
    loader = {"planners": 1, "prefetch": 2, "plan_timeout_s": 30}
    store = {"backend": "tcp", "port": free_port(), "namespace": "faults"}
    env = env_for(store, loader, FAULT="sigkill", FAULT_AT=3)
    codes, logs = run("store_fault_worker.py", tmp_path, env=env, timeout=60)
    assert codes == [0, 0], "\n".join(logs)
    finals = check_result(tmp_path, epochs=1)
    for log, final in zip(logs, finals):
        assert log.count(FAILED) == 1, log
        assert "was killed by signal SIGKILL" in log
        assert max(final["plan_wait_s"][1:]) < 3, final["plan_wait_s"]  # never near local_plan_after_s (7.5 s)


def test_a_store_down_without_a_process_group_fails_after_plan_timeout(fresh_redis_server, monkeypatch):
    """One rank alone (nobody to agree with): it plans locally while the store is down, then raises
    itself once plan_timeout_s has passed, naming the store."""
    monkeypatch.setenv(PASSWORD_ENV, fresh_redis_server.password)
    cfg, cm, lens, data = make(
        store=redis_store(fresh_redis_server, namespace=f"alone-{time.time_ns()}"),
        loader={"planners": 1, "prefetch": 2, "plan_timeout_s": 2},
    )
    loader = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, seed=SEED)
    try:
        loader._source.start_planners(loader.position)
        deadline = time.monotonic() + 60  # its start-up, however loaded the machine, is not what is timed here
        while loader._store.get(plan_key(0, 0, 0)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        next(iter(loader))
        fresh_redis_server.kill()
        t0 = time.monotonic()
        with pytest.raises(
            StoreUnavailable, match=r"has not answered for [\d.]+ s, beyond loader.plan_timeout_s = 2 s"
        ):
            while True:  # epoch after epoch (13 steps each), as training would
                for _ in loader:
                    time.sleep(0.05)
        assert 2 <= time.monotonic() - t0 < 5
    finally:
        loader.close()


def test_local_plan_after_s_must_come_before_the_timeout():
    assert LoaderConfig().plan_late_s == 30 and LoaderConfig(local_plan_after_s=5).plan_late_s == 5
    with pytest.raises(ValueError, match="local_plan_after_s = 120 would never come before plan_timeout_s = 120"):
        LoaderConfig(local_plan_after_s=120.0)


@pytest.fixture(autouse=True)
def no_stopped_planner_left(tmp_path):
    """A failed assertion must not leave a stopped planner behind."""
    yield
    pid_file = tmp_path / "planner.pid"
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
