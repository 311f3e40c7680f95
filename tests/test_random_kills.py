"""Training killed by SIGKILL at seeded random points (during planner start-up, before and after a
checkpoint), resumed each time, with the TCP and the Redis store in turn: no sample lost or
repeated, and the parameters equal an uninterrupted run's. The long version is marked slow:
``pytest -m slow tests/test_random_kills.py``."""

import json
import time

import numpy as np
import pytest
import torch

from dyn_plugin.layout import RankLayout
from dyn_plugin.runtime.loader import DynLoader
from kill_worker import SEED, initial_params, local_gradient, setup, update
from ranks import free_port, run


def uninterrupted(epochs: int) -> torch.Tensor:
    """The same training on both ranks' loaders in this process, never killed."""
    cfg, cm, lens, data = setup({"backend": "none"})
    loaders = [
        DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(2), column=r, seed=SEED)
        for r in range(2)
    ]
    params = initial_params()
    for _ in range(epochs):
        for steps in zip(*[list(loader) for loader in loaders]):  # whole epochs: zip would stop one loader early
            grads = [local_gradient(params, s, lens) for s in steps]
            params = update(params, grads[0] + grads[1], steps[0])
    return params


def train_with_kills(tmp_path, server, *, kills: int, epochs: int, seed: int) -> int:
    rng = np.random.default_rng(seed)
    print(f"kill points drawn with seed {seed}")
    done, killed, launches = False, 0, 0
    while not done:
        if killed < kills:
            where = (
                ["startup", "before-save", "after-save"][killed % 3]
                if killed < 3
                else str(rng.choice(["startup", "before-save", "after-save"]))
            )
            kill = where if where == "startup" else f"{int(rng.integers(1, 3))}:{where}"
        else:
            kill = "none"
        if launches % 2 == 0:
            store = {"backend": "tcp", "port": free_port(), "namespace": "kills"}
            env = {}
        else:
            store = {"backend": "redis", "url": server.url, "namespace": "kills"}
            env = {"DYN_PLUGIN_REDIS_PASSWORD": server.password}
        codes, logs = run(
            "kill_worker.py",
            tmp_path,
            env={"TEST_STORE": json.dumps(store), "KILL_AT": kill, "EPOCHS": str(epochs), **env},
            timeout=120,
        )
        launches += 1
        print(f"launch {launches}: {store['backend']} store, kill at {kill}: exit codes {codes}")
        if kill != "none" and codes == [-9, -9]:
            killed += 1
        else:
            assert codes == [0, 0], logs
            done = True
    finals = [json.loads((tmp_path / f"final{r}.json").read_text()) for r in range(2)]
    n = len(setup({"backend": "none"})[2])
    samples = [i for f in finals for step in f["consumed"] for i in step]
    assert sorted(samples) == sorted(list(range(n)) * epochs), "samples lost or repeated"
    assert finals[0]["params"] == finals[1]["params"]
    assert torch.equal(torch.tensor(finals[0]["params"], dtype=torch.float64), uninterrupted(epochs))
    return killed


def test_three_random_kills_lose_and_repeat_nothing(tmp_path, redis_server):
    assert train_with_kills(tmp_path, redis_server, kills=3, epochs=1, seed=time.time_ns() % 2**32) == 3


@pytest.mark.slow
def test_twenty_random_kills_lose_and_repeat_nothing(tmp_path, redis_server):
    t0 = time.time()
    killed = train_with_kills(tmp_path, redis_server, kills=20, epochs=4, seed=time.time_ns() % 2**32)
    print(f"{killed} kills survived in {time.time() - t0:.0f} s")
    assert killed == 20
