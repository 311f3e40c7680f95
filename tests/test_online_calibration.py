"""Online time calibration (dyn_plugin/cost/online.py): factors fitted from the run's measured
micro-batches converge on a known distortion of the profiled model, ignore pauses and warm-up,
move by bounded steps, and come out bit-identical wherever the same observations are fed.

The "machine" is the bundled A100 profile (it has a real per-pair attention term) distorted by a
known calibration; lengths are long-tailed (lognormal), micro-batches padded and packed, spread
over the four stages of a pipeline (the first holds the embedding, the last the head)."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from dyn_plugin.cost.bundled import load_bundled
from dyn_plugin.cost.model import StageSpec, features, split_layers
from dyn_plugin.cost.native import core
from dyn_plugin.cost.online import (
    Calibration,
    CalibrationSettings,
    Observation,
    OnlineCalibrator,
    split_terms,
)
from dyn_plugin.cost.profile import cost_model_from_profile
from dyn_plugin.cost.table import LinearFit, TableCostModel, evaluate_stage

STAGES = 4
MAX_TOKENS = 8192
MAX_LEN = 4096


@pytest.fixture(scope="module")
def base() -> TableCostModel:
    return cost_model_from_profile(load_bundled("a100-gpt-6.7b"))


@pytest.fixture(scope="module")
def specs(base) -> list[StageSpec]:
    return split_layers(base.num_layers, STAGES)


def micro_batches(rng: np.random.Generator, n: int = 64, median: float = 500.0) -> list[tuple[str, tuple[int, ...]]]:
    """One global batch of long-tailed lengths, cut into micro-batches of at most MAX_TOKENS token
    slots (sorted, so padded ones are nearly uniform in length, as a planner would cut them)."""
    lens = np.clip(rng.lognormal(math.log(median), 1.0, n), 16, MAX_LEN).astype(int)
    layout = "padded" if rng.random() < 0.5 else "packed"
    out, cur = [], []
    for L in sorted(lens.tolist()):
        trial = cur + [L]
        slots = len(trial) * max(trial) if layout == "padded" else sum(trial)
        if slots > MAX_TOKENS and cur:
            out.append((layout, tuple(cur)))
            trial = [L]
        cur = trial
    out.append((layout, tuple(cur)))
    return out


def step_observations(
    truth: TableCostModel,
    specs: list[StageSpec],
    rng: np.random.Generator,
    step: int,
    *,
    noise: float = 0.0,
    pauses: float = 0.0,
    median: float = 500.0,
    sequences: int = 64,
) -> list[Observation]:
    """What the hosts would measure in one step on the machine ``truth`` prices."""
    out = []
    for i, (layout, lens) in enumerate(micro_batches(rng, sequences, median)):
        stage = i % len(specs)
        cost = evaluate_stage(truth.table(layout, "none", 1), features(lens, layout, truth.pad_multiple), specs[stage])
        fwd, bwd = cost.forward_ms, cost.backward_ms
        if noise:
            fwd, bwd = fwd * rng.lognormal(0, noise), bwd * rng.lognormal(0, noise)
        if pauses and rng.random() < pauses:  # a GC pause: the whole micro-batch 5-10x slower
            k = rng.uniform(5, 10)
            fwd, bwd = fwd * k, bwd * k
        out.append(Observation(lens, layout, "none", 1, stage, fwd, bwd, step))
    return out


def run(calibrator: OnlineCalibrator, truth, specs, steps: int, seed: int = 0, **kw) -> list[Calibration]:
    """Feed ``steps`` steps and update after each; the versions published, in order."""
    rng = np.random.default_rng(seed)
    versions = []
    for step in range(steps):
        calibrator.observe(step_observations(truth, specs, rng, step, **kw))
        new = calibrator.maybe_update(step)
        if new is not None:
            versions.append(new)
    return versions


def fast(**kw) -> CalibrationSettings:
    return CalibrationSettings(**{"warmup_steps": 2, "every": 1, "window": 128, **kw})


def machine(**factors) -> Calibration:
    return Calibration(**factors)


SLOWER = machine(forward_token=2.0, forward_pair=2.0, backward_token=2.0, backward_pair=2.0)
ATTENTION = machine(forward_pair=1.5, backward_pair=1.5)
BOTH = machine(forward_token=1.3, forward_pair=1.6, backward_token=0.7, backward_pair=1.4)


# -- applying a calibration ---------------------------------------------------------------------


def test_identity_leaves_every_prediction_unchanged(base, specs):
    same = Calibration().apply(base)
    assert same is not base and same.tables is not base.tables
    rng = np.random.default_rng(1)
    batches = micro_batches(rng) + micro_batches(rng)
    for (layout, recompute, tp), t in base.tables.items():
        assert np.array_equal(same.tables[(layout, recompute, tp)].coef_array(), t.coef_array())
        assert np.array_equal(same.tables[(layout, recompute, tp)].band_array(), t.band_array())
        for spec in specs:
            for _, lens in batches[:4]:
                kw = dict(layout=layout, recompute=recompute, tp=tp, stage=spec)
                assert same.micro_batch_cost(lens, **kw) == base.micro_batch_cost(lens, **kw)
    if core is not None:  # what the planners evaluate: the C++ tables built from the copy
        lens = np.array(batches[0][1], dtype=np.int64)
        for spec in specs:
            args = (lens, spec.num_layers, spec.first, spec.last)
            assert same.native("packed", "none").stage_cost(*args) == base.native("packed", "none").stage_cost(*args)


def test_factors_scale_time_terms_and_leave_memory(base, specs):
    before = {k: t.coef_array().copy() for k, t in base.tables.items()}
    cal = Calibration(version=1, forward_token=2.0, forward_pair=3.0, backward_token=0.5, backward_pair=4.0)
    scaled = cal.apply(base)
    lens = (300, 900, 2500, 4000)  # large enough that no floor binds
    for spec in specs:
        for layout in ("padded", "packed"):
            t = base.table(layout, "none", 1)
            f = features(lens, layout, base.pad_multiple)
            ft, fp = split_terms(t, f, spec, "forward_ms")
            bt, bp = split_terms(t, f, spec, "backward_ms")
            got = scaled.micro_batch_cost(lens, layout=layout, stage=spec)
            was = base.micro_batch_cost(lens, layout=layout, stage=spec)
            assert ft + fp == pytest.approx(was.forward_ms, rel=1e-12)
            assert fp > 0.05 * was.forward_ms  # the pair term is real here
            assert got.forward_ms == pytest.approx(2.0 * ft + 3.0 * fp, rel=1e-12)
            assert got.backward_ms == pytest.approx(0.5 * bt + 4.0 * bp, rel=1e-12)
            assert (got.stored_bytes, got.peak_bytes) == (was.stored_bytes, was.peak_bytes)
            if core is not None:
                native = scaled.native(layout, "none").stage_cost(
                    np.array(lens, dtype=np.int64), spec.num_layers, spec.first, spec.last
                )
                assert native[:2] == pytest.approx((got.forward_ms, got.backward_ms), rel=1e-9)
    # the profile itself is untouched
    assert all(np.array_equal(before[k], t.coef_array()) for k, t in base.tables.items())


def test_weight_gradients_and_floors_scale_with_the_backward(base):
    t = base.table("packed", "none", 1)
    layer = {**t.fits["layer"], "weight_ms": LinearFit((0.1, 0.002, 0.0), floor=0.5)}
    model = replace(base, tables={("packed", "none", 1): replace(t, fits={**t.fits, "layer": layer})})
    out = Calibration(backward_token=3.0, backward_pair=5.0, forward_token=7.0).apply(model)
    fits = out.tables[("packed", "none", 1)].fits
    assert fits["layer"]["weight_ms"].coef == pytest.approx((0.3, 0.006, 0.0))
    assert fits["layer"]["weight_ms"].floor == pytest.approx(1.5)
    assert fits["layer"]["forward_ms"].floor == pytest.approx(7.0 * t.fits["layer"]["forward_ms"].floor)
    assert fits["layer"]["stored_bytes"] == t.fits["layer"]["stored_bytes"]
    assert fits["layer"]["stored_bytes"].bands  # banded memory fits pass through as they are


def test_calibration_round_trips_through_json():
    cal = Calibration(
        version=7, from_step=1234, forward_token=1 / 3, forward_pair=math.pi, backward_token=0.1, backward_pair=2.0
    )
    again = Calibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert again == cal and again.to_dict() == cal.to_dict()
    assert Calibration.from_dict(Calibration().to_dict()).is_identity


def test_an_encoder_decoder_is_scaled_whole_and_its_factors_are_learnt():
    """The pair tables are not split into terms: a calibration scales each direction's whole
    prediction (and activation memory), the identity exactly, and the calibrator learns one scale
    per direction from observations priced by their (rows, input width, target width)."""
    from dyn_plugin.cost.bundled import DIR
    from dyn_plugin.cost.encoder_decoder import PairStage, import_t5_tables

    t5 = import_t5_tables(DIR / "measured" / "a100-t5-11b.json")
    stage = PairStage(t5.encoder_layers, t5.decoder_layers, embedding=True, last=True)
    shape = (4, 256, 64)
    before = [float(x) for x in t5.stage_costs(stage, *shape, recompute="full")]
    assert [float(x) for x in Calibration().apply(t5).stage_costs(stage, *shape, recompute="full")] == before
    cal = Calibration(version=1, forward_token=1.5, forward_pair=1.5, backward_token=2.0, backward_pair=2.0, memory=1.2)
    after = [float(x) for x in cal.apply(t5).stage_costs(stage, *shape, recompute="full")]
    assert after == pytest.approx([1.5 * before[0], 2.0 * before[1], 1.2 * before[2], 1.2 * before[3]], rel=1e-12)
    assert t5.scale == (1.0, 1.0, 1.0)  # the profile itself is left as it is

    calibrator = OnlineCalibrator(t5, [stage], CalibrationSettings(warmup_steps=0, every=1, max_change=4.0))
    rng = np.random.default_rng(0)
    for step in range(4):
        observations = []
        for _ in range(8):
            n, se, sd = int(rng.integers(1, 9)), int(rng.integers(1, 9)) * 64, int(rng.integers(1, 5)) * 64
            f, b, _, _ = t5.stage_costs(stage, n, se, sd, recompute="full")
            observations.append(
                Observation((se,) * n, "padded", "full", 1, 0, 1.3 * float(f), 1.8 * float(b), step, (n, se, sd))
            )
        calibrator.observe(observations)
        calibrator.maybe_update(step)
    got = calibrator.calibration
    assert got.forward_token == pytest.approx(1.3, rel=1e-9) and got.backward_token == pytest.approx(1.8, rel=1e-9)
    assert got.forward_pair == got.forward_token and got.backward_pair == got.backward_token
    with pytest.raises(ValueError, match="without its shape"):
        calibrator.observe([Observation((64,), "padded", "full", 1, 0, 1.0, 2.0, 9)])


# -- fitting ---------------------------------------------------------------------------------


@pytest.mark.parametrize("truth", [SLOWER, ATTENTION, BOTH], ids=["all-2x", "attention-1.5x", "both"])
def test_converges_on_a_known_distortion(base, specs, truth):
    calibrator = OnlineCalibrator(base, specs, fast())
    versions = run(calibrator, truth.apply(base), specs, steps=10)
    assert 1 <= len(versions) <= 6
    assert [v.version for v in versions] == list(range(1, len(versions) + 1))
    cal = calibrator.calibration
    for d in ("forward", "backward"):
        for t in ("token", "pair"):
            assert cal.factor(d, t) == pytest.approx(truth.factor(d, t), rel=0.01), (d, t)
    fresh = step_observations(truth.apply(base), specs, np.random.default_rng(99), 100)
    assert calibrator.prediction_error(fresh) < 0.02
    assert calibrator.prediction_error(fresh, Calibration()) > 0.05  # the profile alone was wrong


def test_pair_factor_not_fitted_apart_when_attention_is_negligible(base, specs):
    # every sequence short: the pair part is a sliver of every prediction, so the window cannot
    # say how fast attention runs; one scale for both terms, and the predictions still converge
    truth = machine(forward_token=1.4, forward_pair=3.0, backward_token=1.4, backward_pair=3.0)
    calibrator = OnlineCalibrator(base, specs, fast(min_pair_share=0.1))
    run(calibrator, truth.apply(base), specs, steps=10, median=40.0, sequences=512)
    assert all(fit.joint for fit in calibrator.last_fits.values())
    cal = calibrator.calibration
    assert cal.forward_pair == cal.forward_token and cal.backward_pair == cal.backward_token
    fresh = step_observations(truth.apply(base), specs, np.random.default_rng(5), 100, median=40.0, sequences=512)
    assert calibrator.prediction_error(fresh) < 0.03


def test_pauses_do_not_move_the_factors(base, specs):
    calibrator = OnlineCalibrator(base, specs, fast())
    versions = run(calibrator, base, specs, steps=12, pauses=0.1)
    assert sum(fit.dropped for fit in calibrator.last_fits.values()) > 0
    assert versions == []  # nothing moved by more than the 2% tolerance
    # and with the distortion on top, the fit lands on it despite the pauses
    calibrator = OnlineCalibrator(base, specs, fast())
    run(calibrator, BOTH.apply(base), specs, steps=12, pauses=0.1)
    for d in ("forward", "backward"):
        for t in ("token", "pair"):
            assert calibrator.calibration.factor(d, t) == pytest.approx(BOTH.factor(d, t), rel=0.02), (d, t)


def test_a_lasting_change_is_adopted_once_it_fills_the_window(base, specs):
    calibrator = OnlineCalibrator(base, specs, fast(window=64))
    rng = np.random.default_rng(6)
    for step in range(10):  # the machine as profiled
        calibrator.observe(step_observations(base, specs, rng, step))
        assert calibrator.maybe_update(step) is None
    slower = SLOWER.apply(base)  # then it slows down for good (another job on the node)
    for step in range(10, 30):
        calibrator.observe(step_observations(slower, specs, rng, step))
        calibrator.maybe_update(step)
    assert calibrator.calibration.forward_token == pytest.approx(2.0, rel=0.01)
    assert calibrator.calibration.backward_pair == pytest.approx(2.0, rel=0.01)


def test_one_update_moves_a_factor_by_at_most_max_change(base, specs):
    settings = fast(max_change=1.25)
    calibrator = OnlineCalibrator(base, specs, settings)
    versions = run(calibrator, machine(forward_token=3.0, forward_pair=3.0, backward_token=0.3).apply(base), specs, 8)
    assert versions[0].forward_token == pytest.approx(1.25) and versions[0].backward_token == pytest.approx(0.8)
    for prev, cur in zip([Calibration(), *versions], versions):
        for d in ("forward", "backward"):
            for t in ("token", "pair"):
                ratio = cur.factor(d, t) / prev.factor(d, t)
                assert 1 / 1.25 - 1e-12 <= ratio <= 1.25 + 1e-12


def test_warmup_steps_are_ignored(base, specs):
    calibrator = OnlineCalibrator(base, specs, fast(warmup_steps=3))
    rng = np.random.default_rng(3)
    wild = machine(forward_token=9.0, forward_pair=9.0, backward_token=9.0, backward_pair=9.0).apply(base)
    for step in range(3):  # compiling, allocating: everything 9x slower
        calibrator.observe(step_observations(wild, specs, rng, step))
        assert calibrator.maybe_update(step) is None
    assert calibrator.observations("forward") == calibrator.observations("backward") == 0
    for step in range(3, 10):
        calibrator.observe(step_observations(base, specs, rng, step))
        assert calibrator.maybe_update(step) is None  # the profile is right after warm-up
    assert calibrator.calibration.is_identity


def test_refits_every_n_steps_and_dates_versions_as_asked(base, specs):
    calibrator = OnlineCalibrator(base, specs, fast(every=3))
    rng = np.random.default_rng(4)
    truth = SLOWER.apply(base)
    fitted = []
    for step in range(2, 14):
        calibrator.observe(step_observations(truth, specs, rng, step))
        new = calibrator.maybe_update(step, from_step=step + 2)
        if new is not None:
            fitted.append(step)
            assert new.from_step == step + 2
    assert fitted[:2] == [4, 7] and all(b - a == 3 for a, b in zip(fitted, fitted[1:]))


def test_noise_still_lands_within_three_percent(base, specs):
    calibrator = OnlineCalibrator(base, specs, fast(window=256))
    run(calibrator, BOTH.apply(base), specs, steps=20, noise=0.05)
    fresh = step_observations(BOTH.apply(base), specs, np.random.default_rng(7), 100)  # noise-free
    assert calibrator.prediction_error(fresh) < 0.03
    for d in ("forward", "backward"):
        assert calibrator.calibration.factor(d, "token") == pytest.approx(BOTH.factor(d, "token"), rel=0.03)


def test_forward_only_observations_feed_the_forward_alone(base, specs):
    calibrator = OnlineCalibrator(base, specs, fast())
    obs = [replace(o, backward_ms=None) for o in step_observations(base, specs, np.random.default_rng(0), 5)]
    calibrator.observe(obs)
    assert calibrator.observations("forward") == len(obs) and calibrator.observations("backward") == 0


# -- determinism and checkpoints -------------------------------------------------------------


def test_same_observations_give_bit_identical_calibrations(base, specs):
    rng = np.random.default_rng(11)
    truth = BOTH.apply(base)
    steps = [step_observations(truth, specs, rng, s, noise=0.05, pauses=0.05) for s in range(12)]
    a, b, c = (OnlineCalibrator(base, specs, fast()) for _ in range(3))
    shuffle = np.random.default_rng(0)
    for s, obs in enumerate(steps):
        a.observe(obs)
        b.observe(list(obs))
        c.observe([obs[i] for i in shuffle.permutation(len(obs))])  # gathered in another order
        va, vb, vc = a.maybe_update(s), b.maybe_update(s), c.maybe_update(s)
        assert va == vb == vc
        assert a.calibration.to_dict() == b.calibration.to_dict() == c.calibration.to_dict()
    assert a.calibration.version > 0


def test_state_dict_round_trip_continues_identically(base, specs):
    rng = np.random.default_rng(12)
    truth = BOTH.apply(base)
    steps = [step_observations(truth, specs, rng, s, noise=0.05) for s in range(14)]
    a = OnlineCalibrator(base, specs, fast())
    for s, obs in enumerate(steps[:6]):
        a.observe(obs)
        a.maybe_update(s)
    b = OnlineCalibrator(base, specs, fast())
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.calibration == a.calibration and b.state_dict() == a.state_dict()
    for s, obs in enumerate(steps[6:], start=6):
        a.observe(obs)
        b.observe(obs)
        assert a.maybe_update(s) == b.maybe_update(s)
    assert a.state_dict() == b.state_dict()
    other = Calibration(backward_token=2.0).apply(base)  # another profile: its factors would mean something else
    with pytest.raises(ValueError, match="another cost model"):
        OnlineCalibrator(other, specs, fast()).load_state_dict(a.state_dict())


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"max_change": 0.9}, "max_change"),
        ({"max_change": 1.0}, "max_change"),
        ({"window": 8, "min_observations": 16}, "window"),
        ({"min_observations": 1}, "min_observations"),
        ({"every": 0}, "every"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"outlier": 0.0}, "outlier"),
        ({"tolerance": 0.5, "max_change": 1.25}, "tolerance"),
        ({"min_pair_share": 1.0}, "min_pair_share"),
        ({"min_factor": 0.0}, "min_factor"),
        ({"window": 32.5}, "window"),
    ],
)
def test_bad_settings_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"\b{field} = "):
        CalibrationSettings(**kw)


def test_bad_calibrations_and_observations_are_refused(base, specs):
    with pytest.raises(ValueError, match="forward_pair = 0"):
        Calibration(forward_pair=0.0)
    with pytest.raises(ValueError, match=r"factors\['backward'\]\['token'\]"):
        Calibration.from_dict({"version": 1, "from_step": 0, "factors": {"forward": {"token": 1, "pair": 1}}})
    with pytest.raises(ValueError, match="layout"):
        Observation((8,), "ragged", "none", 1, 0, 1.0, 1.0, 0)
    calibrator = OnlineCalibrator(base, specs, fast())
    with pytest.raises(ValueError, match="stage 4"):
        calibrator.observe([Observation((8,), "packed", "none", 1, 4, 1.0, 1.0, 5)])
    calibrator.observe(step_observations(base, specs, np.random.default_rng(0), 5))
    with pytest.raises(ValueError, match="from_step = 9 at step 9: a version prices steps still to be planned"):
        calibrator.maybe_update(9, from_step=9)


def test_a_stage_that_alone_runs_slower_gets_its_own_factor(base, specs):
    """Stage 2 of 4 runs 2x slower than the profile, the others as profiled: the term factors take
    what every stage shares and the stage factors what stage 2 adds, until the predictions meet the
    measurements on every stage; a planner spec priced with them prices stage 2's times at its pace."""
    from dyn_plugin.config import DynPluginConfig
    from dyn_plugin.plan.steps.pricing import make_micro_batch
    from dyn_plugin.plan.steps.spec import planner_spec

    def observed(rng, step):
        obs = step_observations(base, specs, rng, step)
        return [
            replace(o, forward_ms=2 * o.forward_ms, backward_ms=2 * o.backward_ms) if o.stage == 2 else o for o in obs
        ]

    calibrator = OnlineCalibrator(base, specs, fast())
    rng = np.random.default_rng(0)
    for step in range(30):
        calibrator.observe(observed(rng, step))
        calibrator.maybe_update(step)
    cal = calibrator.calibration
    assert len(cal.stages) == STAGES
    paces = [cal.stage_factor(s) * cal.forward_token for s in range(STAGES)]
    assert paces == pytest.approx([1.0, 1.0, 2.0, 1.0], rel=0.03)
    assert calibrator.prediction_error(observed(np.random.default_rng(99), 100)) < 0.03
    # the same term factors without the stage factors miss every stage
    assert calibrator.prediction_error(observed(np.random.default_rng(99), 100), replace(cal, stages=())) > 0.1
    assert Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal

    cfg = DynPluginConfig.model_validate({"pipeline": {"stages": STAGES}, "cluster": {"device": {"memory_mb": 80000}}})
    spec = planner_spec(base, cfg, dp=1)
    timed = replace(spec, stage_time=(1.0, 1.0, 2.0, 1.0))
    a, b = (make_micro_batch([0, 1], [1000, 3000], spec=s, layout="packed", recompute="none") for s in (spec, timed))
    assert b.forward_ms == (a.forward_ms[0], a.forward_ms[1], 2 * a.forward_ms[2], a.forward_ms[3])
    assert b.backward_ms[2] == 2 * a.backward_ms[2] and b.backward_ms[3] == a.backward_ms[3]
