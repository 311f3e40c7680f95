"""DeepSpeed killed at random points on every path (ZeRO 0-3, the two-stage pipeline, sequence
parallelism) and resumed from its newest whole checkpoint each time: each sample is trained exactly
once and the final parameters equal an uninterrupted run's, bit for bit (the same ops in the same
order on CPU, so any difference is state a checkpoint failed to keep). The kill points and the
harness: tests/kill_harness.py. The long version (100 kills a path) is marked slow:
``pytest -m slow tests/test_deepspeed_kills.py``."""

import functools
import os
import shutil
import time

import pytest
import torch

from ds_kill_worker import PATHS, SAMPLES
from kill_harness import check_exactly_once, train_with_kills
from ranks import free_port, launch

FORWARDS, SAVES = 18, 4  # at most, in one launch's epoch (about 21 forwards, 4 saves): where kill points are drawn


def start(out, path: str, env: dict) -> list:
    return launch("ds_kill_worker.py", out, path, env={**env, "STORE_PORT": str(free_port())}, capture=True)


@functools.cache
def uninterrupted(out, path: str) -> torch.Tensor:
    """The path's parameters after an epoch never killed (once per path and session)."""
    out.mkdir()
    procs = start(out, path, {})
    logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:]
    final = torch.load(out / "final.pt")
    check_exactly_once(final["consumed"], SAMPLES)
    return final["params"]


def kills_on(tmp_path_factory, path: str, kills: int) -> int:
    reference = uninterrupted(tmp_path_factory.getbasetemp() / f"uninterrupted-{path}", path)
    run = tmp_path_factory.mktemp(f"kills-{path}")

    def fresh() -> None:
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir()

    def check() -> None:
        final = torch.load(run / "final.pt")
        check_exactly_once(final["consumed"], SAMPLES)
        assert torch.equal(final["params"], reference), float((final["params"] - reference).abs().max())

    return train_with_kills(
        lambda env: start(run, path, env),
        fresh=fresh,
        check=check,
        kills=kills,
        seed=time.time_ns() % 2**32,
        world=2,
        forwards=FORWARDS,
        saves=SAVES,
        planners="store" in PATHS[path].get("plugin", {}),
    )


# In `make test`, one kill on the paths whose checkpoints differ most (a planner process and the TCP
# store, pipeline stages), within the suite's time (ZeRO-3's sharded states: a kill in
# test_strategy_training and test_fsdp_checkpoint's); every path, and many kills, in the slow tests below.
@pytest.mark.parametrize("path", ["zero1", "pipe"])
def test_a_random_kill_loses_and_repeats_nothing(tmp_path_factory, path):
    assert kills_on(tmp_path_factory, path, kills=1) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(PATHS))
def test_random_kills_lose_and_repeat_nothing(tmp_path_factory, path):
    assert kills_on(tmp_path_factory, path, kills=2) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(PATHS))
def test_hundred_random_kills_lose_and_repeat_nothing(tmp_path_factory, path):
    t0 = time.time()
    kills = int(os.environ.get("KILLS", 100))  # KILLS: a shorter run
    killed = kills_on(tmp_path_factory, path, kills=kills)
    print(f"{path}: {killed} kills survived in {time.time() - t0:.0f} s")
    assert killed == kills
