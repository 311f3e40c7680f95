"""FSDP's checkpoint (dyn_plugin/fsdp/checkpoint.py) on 2 gloo ranks, float32 CPU: a run stopped
inside a save and resumed from the newest whole checkpoint ends bit for bit where an uninterrupted
run does (FSDP2 under a sharding plan, FSDP1 under its policy), and FSDP2 training killed at random
points (tests/kill_harness.py) trains every sample exactly once and ends at the same parameters.
The long version is marked slow: ``pytest -m slow tests/test_fsdp_checkpoint.py``."""

import os
import shutil
import time

import pytest
import torch

from dyn_plugin.fsdp import load_checkpoint, save_checkpoint
from dyn_plugin.layout import RankLayout
from dyn_plugin.runtime.loader import DynLoader
from kill_harness import check_exactly_once, train_with_kills
from ranks import launch, run
from test_loader import make
from token_mean import random_dataset

WORKER = "fsdp_kill_worker.py"
SAMPLES = len(random_dataset(0)[0])
FORWARDS, SAVES = 15, 6  # what one launch of the worker makes: six steps of two or three micro-batches


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The worker's final state per path, never killed: run once per module."""
    finals: dict[str, dict] = {}

    def final(path: str) -> dict:
        if path not in finals:
            out = tmp_path_factory.mktemp(f"uninterrupted-{path}")
            codes, logs = run(WORKER, out, path)
            assert codes == [0, 0], logs[0][-3000:]
            finals[path] = torch.load(out / "final.pt")
            assert finals[path]["resumed"] is None
        return finals[path]

    return final


def assert_same_end(final: dict, reference: dict) -> None:
    check_exactly_once(final["consumed"], SAMPLES)
    assert final["consumed"] == reference["consumed"]
    assert sorted(final["params"]) == sorted(reference["params"])
    for name, p in reference["params"].items():
        assert torch.equal(final["params"][name], p), f"{name} differs by {(final['params'][name] - p).abs().max()}"


@pytest.mark.parametrize("path", ["fsdp2", "fsdp1"])
def test_a_run_resumed_after_a_killed_save_ends_as_an_uninterrupted_one(path, tmp_path, uninterrupted):
    # every rank dies inside the third save, its files half written and its marker never written
    codes, logs = run(WORKER, tmp_path, path, env={"KILL": "save:3@all"})
    assert codes == [-9, -9], logs[0][-3000:]
    ckpt = tmp_path / "ckpt"
    assert sorted(n for n in os.listdir(ckpt) if not n.startswith(".")) == ["step1", "step2", "step3"]
    assert (ckpt / "step2" / "dyn_plugin_checkpoint.json").exists() and (ckpt / "step2" / ".metadata").exists()
    assert not (ckpt / "step3" / "dyn_plugin_checkpoint.json").exists()
    codes, logs = run(WORKER, tmp_path, path)
    assert codes == [0, 0], logs[0][-3000:]
    assert "step3 has no dyn_plugin_checkpoint.json" in logs[0]
    final = torch.load(tmp_path / "final.pt")
    assert final["resumed"] == str(ckpt / "step2")
    assert_same_end(final, uninterrupted(path))


def test_a_save_before_the_first_step_leaves_the_optimizer_fresh(tmp_path):
    """torch's get_state_dict steps an optimizer without state once to make one (Adam's step count
    then starts at 1): the save, and a resume from it, leave it as a fresh one (one process, no group)."""
    cfg, cm, lens, data = make()

    def trainee(seed: int) -> tuple:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 4)
        loader = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(1), column=0)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1), loader

    def one_step(model, optimizer) -> None:
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()

    model, optimizer, loader = trainee(0)
    assert save_checkpoint(model, optimizer, loader, tmp_path, client_state={"note": 1}) == "step0"
    assert not optimizer.state
    resumed, optimizer2, loader2 = trainee(1)
    assert load_checkpoint(resumed, optimizer2, loader2, tmp_path) == (str(tmp_path / "step0"), {"note": 1})
    assert not optimizer2.state
    one_step(model, optimizer)
    one_step(resumed, optimizer2)
    fresh, optimizer3, _ = trainee(0)
    one_step(fresh, optimizer3)
    for a, b, c in zip(model.parameters(), resumed.parameters(), fresh.parameters()):
        assert torch.equal(a, c) and torch.equal(b, c)


def kill_and_resume(tmp_path, uninterrupted, kills: int) -> int:
    """FSDP2 under its sharding plan, killed ``kills`` times at points drawn from a seed it prints."""
    out, reference = tmp_path / "run", uninterrupted("fsdp2")

    def fresh() -> None:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()

    def check() -> None:
        assert_same_end(torch.load(out / "final.pt"), reference)

    return train_with_kills(
        lambda env: launch(WORKER, out, "fsdp2", env=env, capture=True),
        fresh=fresh,
        check=check,
        kills=kills,
        seed=time.time_ns() % 2**32,
        world=2,
        forwards=FORWARDS,
        saves=SAVES,
    )


def test_fsdp2_killed_at_random_points_trains_each_sample_once(tmp_path, uninterrupted):
    assert kill_and_resume(tmp_path, uninterrupted, kills=2) == 2


@pytest.mark.slow
def test_fsdp2_survives_a_hundred_random_kills(tmp_path, uninterrupted):
    t0 = time.time()
    kills = int(os.environ.get("KILLS", 100))  # KILLS: a shorter run
    killed = kill_and_resume(tmp_path, uninterrupted, kills=kills)
    print(f"{killed} kills survived in {time.time() - t0:.0f} s")
    assert killed == kills
