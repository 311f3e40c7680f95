"""Online calibration in the run (runtime/calibration.py): the loader's steps hand their measured
micro-batches back, every rank gathers them and refits alike, and later steps are planned with the
new version on every rank and by the planner processes (through the store); the versions travel
with the loader's position."""

import json

import numpy as np
import pytest

from dyn_plugin.layout import RankLayout
from dyn_plugin.runtime.loader import DynLoader
from ranks import free_port, run
from test_loader import make

CALIBRATION = {"warmup_steps": 1, "every": 2, "min_observations": 8}


@pytest.mark.parametrize("backend", ["none", "tcp"])
def test_ranks_and_planners_plan_alike_as_the_calibration_converges(tmp_path, backend):
    """2 gloo ranks measure a machine 2x slower than the profile (3x on attention), each with its own
    noise: the calibration reaches those factors, its error falls, and at every step both ranks hold
    one plan, the one each rank's own context makes with the versions it holds (with a store: the
    planner processes picked up every version in time)."""
    store = {"backend": "tcp", "port": free_port(), "namespace": "calibration"} if backend == "tcp" else None
    env = {"TEST_STORE": json.dumps(store or {"backend": "none"})}
    codes, logs = run("calibration_worker.py", tmp_path, env=env, timeout=240)
    assert codes == [0, 0], logs[0][-3000:]
    ranks = [[json.loads(line) for line in open(tmp_path / f"rank{r}.jsonl")] for r in range(2)]
    *steps0, end0 = ranks[0]
    *steps1, end1 = ranks[1]
    assert len(steps0) == len(steps1) == 24
    for a, b in zip(steps0, steps1):
        assert a["digest"] == b["digest"] and a["version"] == b["version"]
        assert a["digest"] == a["local"] and b["digest"] == b["local"]
    assert end0 == end1  # the same calibration on both ranks, the same errors
    versions = [s["version"] for s in steps0]
    assert versions == sorted(versions) and versions[-1] >= 4  # bounded steps of at most 1.25x each
    factors = end0["factors"]
    for direction in ("forward", "backward"):
        assert factors[direction]["token"] == pytest.approx(2.0, rel=0.08)
        assert factors[direction]["pair"] == pytest.approx(3.0, rel=0.15)
    errors = [e for _, e in end0["errors"]]
    assert errors[0] > 0.4 and errors[-1] < 0.08  # the profile's error, then the calibrated one


def _loader(**over):
    cfg, cm, lens, data = make(n=300, calibration={**CALIBRATION, **over})
    return DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(1), seed=5)


def _slow(step, factor=2.0):
    """Timings of a machine ``factor`` x slower than the step's plan predicted, per micro-batch."""
    n = len(step.loaded)
    return [(factor * step.predicted_ms / n / 3, factor * 2 * step.predicted_ms / n / 3)] * n


def test_later_steps_are_priced_by_the_calibration_and_a_resume_keeps_it(tmp_path):
    loader = _loader()
    steps = iter(loader)
    for _ in range(12):
        step = next(steps)
        step.observe(_slow(step))
    assert len(loader.context.calibrations) > 1
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = _loader()
    resumed.load_state_dict(state)
    mine, theirs = next(steps), next(iter(resumed))
    assert mine.digest == theirs.digest and mine.predicted_ms == theirs.predicted_ms
    assert resumed.context.calibrations == loader.context.calibrations
    # the same global batch, planned by the profile alone, is predicted faster
    plain = _loader(enabled=False)
    plain.load_state_dict(state)
    assert next(iter(plain)).predicted_ms < 0.9 * mine.predicted_ms
    assert plain.calibration is None and mine.observe is not None


def test_a_version_prices_only_the_steps_after_the_lag():
    """A version fitted after position p prices p + 1 + lag on: positions already planned keep theirs."""
    loader = _loader()
    steps = iter(loader)
    for position in range(12):
        step = next(steps)
        before = len(loader.context.calibrations)
        step.observe(_slow(step, 3.0))
        if len(loader.context.calibrations) > before:
            new = loader.context.calibrations[-1]
            assert new.from_step == position + 1  # no store: nothing planned ahead
            assert loader.context.calibration_at(position).version == new.version - 1
            return
    pytest.fail("no calibration version in 12 steps")


def test_no_timings_no_calibration():
    """Steps whose host records nothing (a pipeline's) leave the profile as it is."""
    loader = _loader()
    steps = [step for _, step in zip(range(8), loader)]
    assert len(loader.context.calibrations) == 1
    assert all(np.isfinite(s.predicted_ms) for s in steps)
