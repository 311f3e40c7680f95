"""The encoder-decoder (T5) cost model fitted to the measured A100 tables (cost/encoder_decoder.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dyn_plugin.cost.bundled import MEASURED_DIR
from dyn_plugin.cost.encoder_decoder import MB, PairStage, held_out_pairs, import_t5_tables, pair_shape
from dyn_plugin.cost.model import OutOfProfileRange

T5 = MEASURED_DIR / "a100-t5-11b.json"


@pytest.fixture(scope="module")
def raw():
    with open(T5) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def model(raw):
    return import_t5_tables(raw)


def test_held_out_error_within_bounds(raw):
    """Each interior length (pair of lengths) left out and predicted from the rest, on one table
    (tp 1, selective: the whole grid takes a minute); the figures for every table are in BENCHMARKS."""
    one = {**raw, "tables": [t for t in raw["tables"] if (t["tp"], t["recompute"]) == (1, "selective")]}
    rows = [r for r in held_out_pairs(one) if not r["edge"]]
    assert {r["side"] for r in rows} == {"encoder", "decoder"}
    for side in ("encoder", "decoder"):
        for metric, mean_bound, worst_bound in (
            ("forward_ms", 0.10, 0.35),
            ("backward_ms", 0.10, 0.35),
            ("stored_bytes", 0.05, 0.20),
            ("peak_bytes", 0.10, 0.85),
        ):
            errs = np.array([r["error"] for r in rows if r["side"] == side and r["metric"] == metric])
            assert len(errs) > 5
            assert np.abs(errs).mean() <= mean_bound, (side, metric, np.abs(errs).mean())
            assert np.abs(errs).max() <= worst_bound, (side, metric, np.abs(errs).max())


def test_fits_reproduce_measured_points(model, raw):
    table = next(t for t in raw["tables"] if (t["tp"], t["recompute"]) == (2, "none"))
    # a decoder layer's peak at a measured point is read off the grid; times within the fit's error
    (se, sd), b, peak = next(r for r in table["peak_activation_mb"]["decoder"] if r[0] == [1024, 512] and r[1] == 4)
    stage = PairStage(decoder_layers=1)
    fwd, _, stored, got_peak = model.stage_costs(stage, b, se, sd, recompute="none", tp=2)
    carried = b * se * 1024 * 2  # the encoder output the decoder stage holds
    layer_peak = got_peak - carried * 2
    assert layer_peak == pytest.approx(peak * MB, rel=0.02)
    measured_fwd = [r[2] for r in table["time_ms"]["decoder.forward"] if r[0] == [1024, 512] and r[1] == 4]
    assert fwd == pytest.approx(np.median(measured_fwd), rel=0.15)


def test_units_are_decimal_megabytes(model):
    # (32128 + 8192 learned positions) x 1024 fp16 parameters = 82.58e6 bytes: the table's 82.58 "MB"
    assert model.table("none", 1).params["embedding"] == pytest.approx((32128 + 8192) * 1024, rel=1e-4)


def test_out_of_range_is_refused(model):
    enc = PairStage(encoder_layers=12, embedding=True)
    model.micro_batch_cost([4096], [16], stage=enc, recompute="none", tp=1)  # measured
    with pytest.raises(OutOfProfileRange, match="outside what cost model"):
        model.micro_batch_cost([8192], [16], stage=enc, recompute="none", tp=1)  # tp 1 measured up to 4096
    with pytest.raises(OutOfProfileRange):  # tp 1, no recompute: targets of 4096 measured only with inputs up to 2048
        model.micro_batch_cost([4096], [4096], stage=PairStage(decoder_layers=12), recompute="none", tp=1)
    model.micro_batch_cost([4096], [4096], stage=PairStage(decoder_layers=12), recompute="selective", tp=1)
    with pytest.raises(OutOfProfileRange, match="no table"):
        model.micro_batch_cost([16], [16], stage=enc, recompute="none", tp=3)


def test_costs_grow_with_the_micro_batch(model):
    for side in ("encoder", "decoder"):
        stage = PairStage(**{f"{side}_layers": 6}, last=side == "decoder")
        for rc in ("none", "selective", "full"):
            costs = [np.array(model.stage_costs(stage, n, 512, 256, recompute=rc, tp=1)) for n in (1, 2, 4, 8)]
            assert all(np.all(b >= a) for a, b in zip(costs, costs[1:])), (side, rc)
    # recompute trades time for memory
    st = PairStage(decoder_layers=12)
    none = model.stage_costs(st, 4, 1024, 512, recompute="none", tp=1)
    full = model.stage_costs(st, 4, 1024, 512, recompute="full", tp=1)
    assert full[1] > none[1] and full[2] < none[2] / 10


def test_model_states_per_stage(model):
    p = model.table("none", 1).params
    first_dec = PairStage(decoder_layers=12, embedding=True, last=True)
    assert model.stage_params(PairStage(encoder_layers=12, embedding=True)) == pytest.approx(
        12 * p["encoder"] + p["embedding"]
    )
    # one stage holding both sides (pp = 1) shares one embedding, which the head is tied to
    both = PairStage(24, 24, embedding=True, last=True)
    assert model.stage_params(both) == pytest.approx(24 * (p["encoder"] + p["decoder"]) + p["embedding"])
    with pytest.raises(ValueError, match="a stage needs layers"):
        PairStage()
    assert model.stage_params(first_dec) == pytest.approx(12 * p["decoder"] + p["embedding"])
    last = PairStage(decoder_layers=12, last=True)
    assert model.stage_params(last) == pytest.approx(12 * p["decoder"] + 32128 * 1024)  # the tied output layer's copy
    states = model.model_state_bytes(stage=last, zero_stage=1, dp=2)
    assert states.params == pytest.approx(2 * model.stage_params(last))


def test_bad_pairs_are_refused():
    with pytest.raises(ValueError, match="as many inputs as targets"):
        pair_shape([3, 4], [5])
    with pytest.raises(ValueError, match="positive"):
        pair_shape([0], [5])
    assert pair_shape([3, 17], [9, 1]) == (2, 24, 16)
