"""Online calibration in the run (runtime/calibration.py): the loader's steps hand their measured
micro-batches back, every rank gathers them and refits alike, and later steps are planned with the
new version on every rank and by the planner processes (through the store); the versions travel
with the loader's position."""

import json

import numpy as np
import pytest

from dyn_plugin.layout import RankLayout
from dyn_plugin.plan.steps.spec import MB
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
    assert end0["memory"] == pytest.approx(1.3 * 1.03, rel=1e-6)  # the larger rank's, gathered
    errors = [e for _, e in end0["errors"]]
    assert errors[0] > 0.4 and errors[-1] < 0.08  # the profile's error, then the calibrated one


def _loader(**over):
    cfg, cm, lens, data = make(n=300, calibration={**CALIBRATION, **over})
    return DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(1), seed=5)


def _slow(step, factor=2.0) -> list:
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


def _tight_loader(**over):
    """Plans bound by memory: a device of 40 MB for the tiny model's activations."""
    cfg, cm, lens, data = make(
        n=300, cluster={"device": {"memory_mb": 40, "memory_fraction": 1.0}}, calibration={**CALIBRATION, **over}
    )
    return DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(1), seed=5)


def _true_peak(loader, step, activations: float) -> float:
    """Bytes the step would really reach on a device whose activations are ``activations`` x the
    profile's (the plan predicted its peak under the calibration it was priced with)."""
    states = loader.context.spec.memory[0].states
    planned = loader.context.calibration_at(loader.context.position(step.epoch, step.index)).memory
    return states + activations * (step.predicted_peak_mb * MB - states) / planned


def _run(loader, activations: float, steps: int) -> list[float]:
    """Each step's true peak over the bytes plans may fill, its timings and measured peak handed back."""
    plannable = loader.config.cluster.device.plannable_mb * MB
    fills = []
    for _, step in zip(range(steps), loader):
        peak = _true_peak(loader, step, activations)
        fills.append(peak / plannable)
        step.observe(_slow(step, 1.0), peak)
    return fills


def test_a_measured_peak_above_the_plan_raises_the_memory_factor_before_the_next_step():
    """Activations 1.5x the profile's: after the first measured step past warm-up the memory factor
    rises at once (the next step is priced with it) and no later step overflows, where the plans of
    the profile alone, the same global batches, overflow."""
    calibrated, static = _tight_loader(), _tight_loader(enabled=False)
    fills = _run(calibrated, 1.5, 10)
    memory = [c.memory for c in calibrated.context.calibrations]
    assert memory[-1] == pytest.approx(1.5 * 1.03, rel=1e-6)  # the largest ratio, with the headroom
    rise = next(c for c in calibrated.context.calibrations if c.memory > 1)
    assert rise.from_step == 2  # measured at step 1 (the first past warm-up), priced from the next
    assert max(fills[2:]) <= 1.0
    static_fills = [_true_peak(static, step, 1.5) / (static.config.cluster.device.plannable_mb * MB)
                    for _, step in zip(range(10), static)]  # fmt: skip
    assert max(static_fills[2:]) > 1.0  # what the calibration kept from running


def test_a_peak_below_the_plan_lowers_the_memory_factor_gradually_and_the_plans_fill_the_device():
    """Activations 0.6x the profile's: the factor falls by at most max_change a refit, and once it has,
    the plans fill >= 90% of the memory plans may use (not the 60% the profile's estimate leaves)."""
    loader = _tight_loader()
    fills = _run(loader, 0.6, 24)
    memory = [c.memory for c in loader.context.calibrations]
    assert all(b >= a / 1.25 - 1e-12 for a, b in zip(memory, memory[1:]))
    assert memory[-1] == pytest.approx(0.6 * 1.03, rel=1e-6)
    assert max(fills[:2]) < 0.7 and max(fills[-6:]) >= 0.9 and max(fills) <= 1.0


def test_a_plan_made_ahead_with_an_older_calibration_is_planned_again():
    """With a store, planner processes plan ahead; a step whose plan was priced with an older version
    than the one that prices it is planned on the rank (the same plan on every rank)."""
    cfg, cm, lens, data = make(
        n=300,
        store={"backend": "tcp", "port": 0, "namespace": "calibration-stale"},
        loader={"planners": 1, "prefetch": 4},
        cluster={"device": {"memory_mb": 40, "memory_fraction": 1.0}},
        calibration=CALIBRATION,
    )
    loader = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(1), seed=5)
    try:
        for _, step in zip(range(8), loader):
            version = loader.context.calibration_at(loader.context.position(step.epoch, step.index)).version
            assert step.digest == loader.context.plan(step.epoch, step.index)[(0, 0)].digest, version
            step.observe(_slow(step, 1.0), _true_peak(loader, step, 1.5))
        assert len(loader.context.calibrations) > 1
    finally:
        loader.close()


class _DownStore:
    """A plan store that is down for its first ``down`` puts, then takes them."""

    def __init__(self, down: int) -> None:
        self.down, self.kept = down, {}

    def put(self, key: str, value: bytes) -> None:
        from dyn_plugin.store import StoreUnavailable

        if self.down > 0:
            self.down -= 1
            raise StoreUnavailable("the plan store at tcp://test has not answered")
        self.kept[key] = value


def test_a_store_down_when_a_version_is_published_does_not_stop_training(caplog):
    """The host rank publishes each version; a store that is down then is warned about once, training
    goes on with the version, and every version is in the store once it answers again."""
    from dyn_plugin.runtime.calibration import CALIBRATION_KEY, RunCalibration

    loader, store = _loader(), _DownStore(down=3)
    loader.calibration = RunCalibration(
        loader.context, loader.config.calibration, lag=0, store=lambda: store, host=True
    )
    published = []
    for _, step in zip(range(14), loader):
        step.observe(_slow(step))
        published.append(CALIBRATION_KEY in store.kept)
    versions = [c.to_dict() for c in loader.context.calibrations[1:]]
    assert len(versions) > 1 and not published[0]
    assert store.down == 0 and json.loads(store.kept[CALIBRATION_KEY]) == versions
    warned = [r for r in caplog.records if "not published" in r.getMessage()]
    assert len(warned) == 1 and "put again after the next step" in warned[0].getMessage()


def test_an_encoder_decoders_pairs_are_calibrated():
    """T5 pairs (the pair planner's plans, priced by the pair tables): a machine 1.7x slower than the
    tables is learnt, one scale per direction, and later global batches are priced with it."""
    from dyn_plugin.config import DynPluginConfig
    from dyn_plugin.cost.bundled import DIR
    from dyn_plugin.cost.encoder_decoder import import_t5_tables

    cfg = DynPluginConfig.model_validate(
        {
            "microbatching": {"global_tokens": 4096, "max_seq_len": 512},
            "cluster": {"device": {"memory_mb": 400000}},
            "pipeline": {"stages": 1},
            "calibration": CALIBRATION,
        }
    )
    rng = np.random.default_rng(0)
    pairs = np.stack([rng.integers(16, 400, size=200), rng.integers(8, 200, size=200)], axis=1)
    data = [{"input_ids": rng.integers(2, 100, size=a), "labels": rng.integers(2, 100, size=b)} for a, b in pairs]
    cost = import_t5_tables(DIR / "measured" / "a100-t5-11b.json")
    loader = DynLoader(data, lengths=pairs, config=cfg, cost_model=cost, layout=RankLayout(1), seed=5)
    stage = loader.context.spec.stages[0]

    def measured(desc) -> tuple[float, float]:  # 1.7x what the tables say, each direction
        f, b, _, _ = cost.stage_costs(stage, *desc.shape, recompute=desc.recompute)
        return 1.7 * float(f), 1.7 * float(b)

    for _, step in zip(range(14), loader):
        step.observe([measured(desc) for desc in step.loaded])
    final = loader.context.calibrations[-1]
    assert final.forward_token == pytest.approx(1.7, rel=1e-6) and final.backward_token == pytest.approx(1.7, rel=1e-6)
    assert final.forward_pair == final.forward_token  # pair tables are scaled whole: the terms are not split
    errors = [e for _, e in loader.calibration.errors]
    assert errors[0] == pytest.approx(0.7 / 1.7) and errors[-1] < 1e-6
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = DynLoader(data, lengths=pairs, config=cfg, cost_model=cost, layout=RankLayout(1), seed=5)
    resumed.load_state_dict(state)
    assert resumed.context.calibrations == loader.context.calibrations
    plain = DynLoader(data, lengths=pairs, config=cfg, cost_model=cost, layout=RankLayout(1), seed=5)
    plain.load_state_dict({**state, "calibration": None})
    # the same global batch: the calibrated model prices it 1.7x the tables' (the update step aside)
    ahead, again = next(iter(loader)), next(iter(plain))
    assert ahead.predicted_ms > 1.5 * again.predicted_ms


def test_a_stage_factor_prices_that_stage_of_an_encoder_decoders_pairs():
    """The pair planner prices a stage at its calibrated pace too, its split backward's W with it."""
    from dataclasses import replace

    from dyn_plugin.config import DynPluginConfig
    from dyn_plugin.cost.bundled import DIR
    from dyn_plugin.cost.encoder_decoder import import_t5_tables
    from dyn_plugin.plan.steps.pair_microbatch import make_pair_micro_batch
    from dyn_plugin.plan.steps.pair_spec import pair_planner_spec

    cost = import_t5_tables(DIR / "measured" / "a100-t5-11b.json")
    cfg = DynPluginConfig.model_validate(
        {"pipeline": {"stages": 2, "schedule": "zero_bubble"}, "cluster": {"device": {"memory_mb": 400000}}}
    )
    spec = pair_planner_spec(cost, cfg, dp=1)
    timed = replace(spec, stage_time=(1.0, 3.0))
    a, b = (make_pair_micro_batch([0, 1], [300, 200], [100, 60], spec=s, recompute="full") for s in (spec, timed))
    assert b.forward_ms == (a.forward_ms[0], 3 * a.forward_ms[1])
    assert b.backward_ms == (a.backward_ms[0], 3 * a.backward_ms[1])
    assert a.weight_ms and b.weight_ms == (a.weight_ms[0], 3 * a.weight_ms[1])
