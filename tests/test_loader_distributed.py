"""DynLoader on 2 gloo ranks: agreement, exactly once, crash and resume, no orphan planners,
with no store, the embedded TCPStore and a real Redis server."""

import json
import os
import time

import pytest

from ranks import free_port, run
from test_loader import make


def run_ranks(out, mode, store=None, env=None):
    codes, _ = run(
        "dist_loader_worker.py",
        out,
        mode,
        env={"TEST_STORE": json.dumps(store or {"backend": "none"}), **(env or {})},
        timeout=120,
    )
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
    if store:  # one run id, drawn by rank 0 and broadcast, under the configured namespace
        spaces = [(tmp_path / f"namespace{r}.txt").read_text() for r in range(2)]
        assert spaces[0] == spaces[1] and spaces[0].startswith(store["namespace"] + "-"), spaces


@pytest.mark.parametrize("skew", ["lengths", "config"])
def test_ranks_holding_different_plans_fail_naming_the_rank_and_the_cause(tmp_path, skew):
    assert run_ranks(tmp_path, f"skew:{skew}") == [0, 0]
    for r in range(2):
        message = (tmp_path / f"mismatch{r}.txt").read_text()
        assert "epoch 0 step 0: rank(s) [1] differ from rank 0" in message, message
        assert f"likely cause: different {skew} on those ranks" in message, message
        other = "config" if skew == "lengths" else "lengths"
        assert f"different {other}" not in message and "cost model" in message  # the fingerprints are listed


def test_a_stale_stop_key_does_not_stop_a_new_runs_planners(redis_server, monkeypatch):
    """An earlier run with the same namespace left its stop key behind; the new run still gets plans."""
    from dyn_plugin.config import StoreConfig
    from dyn_plugin.layout import RankLayout
    from dyn_plugin.runtime.loader import DynLoader
    from dyn_plugin.store import open_store

    store = {"backend": "redis", "url": redis_server.url, "namespace": f"stale-{time.time_ns()}"}
    monkeypatch.setenv("DYN_PLUGIN_REDIS_PASSWORD", redis_server.password)
    with open_store(StoreConfig(**store), rank=0, world_size=1) as old:
        old.put("stop", b"1")  # what every run wrote before stop keys carried the pool's token
    cfg, cm, lens, data = make(store=store, loader={"plan_timeout_s": 15})
    # two ranks without a process group keep the configured namespace as it is
    loaders = [
        DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(2), column=r, seed=3)
        for r in range(2)
    ]
    try:
        assert loaders[0]._store.namespace == store["namespace"]
        steps = [list(l) for l in loaders]
        assert len(steps[0]) == len(steps[1]) > 1
    finally:
        for l in loaders:
            l.close()


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
    assert not any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in pids), (
        "planner processes outlived the trainer"
    )


def _state(pid) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().split(")")[1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.parametrize("copies", ["whole", "stale"])
def test_every_node_keeps_its_own_loader_state(tmp_path, copies):
    """No shared filesystem: each rank plays a node with its own checkpoint directory, each writes
    its own marker and resumes from its own copy. When one node's copy is another save under the
    same name, the ranks agree on markers, not names: the resume is refused on both ranks (not on
    rank 1 alone, which would leave rank 0 waiting in its first collective)."""
    codes, logs = run("ckpt_node_worker.py", tmp_path, copies, timeout=120)
    assert codes == [0, 0], logs
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(2)]
    if copies == "whole":
        assert results[0] == results[1] == {"written": True, "resumed_step": 2, "next_digest_equal": True}
    else:
        assert results[0]["written"] and results[1]["written"]
        said = [results[r]["error"].replace(f"node{r}", "nodeN") for r in range(2)]  # each names its own copy
        assert said[0] == said[1] and "the ranks read different markers" in said[0] and "a stale copy" in said[0]
