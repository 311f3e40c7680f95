"""The encoder-decoder profiler (dyn_plugin/profiling/pairs.py) on the tiny T5: `dynplugin profile
--model tiny-t5` on a tiny grid, its tables read by cost.encoder_decoder.import_t5_tables, the
regression that separates encoder layer, decoder layer and postprocess, and the refusals."""

import json

import numpy as np
import pytest

from dyn_plugin.cli import main
from dyn_plugin.cost.encoder_decoder import MB, PairStage, decoder_terms, import_t5_tables, linear_fit_at
from dyn_plugin.cost.model import MEGATRON_LOSS_BYTES, OutOfProfileRange
from dyn_plugin.profiling.pairs import _time_rows
from dyn_plugin.profiling.workload import ProfileGrid

ARGS = ["--seq-lens", "16,32", "--micro-batch-sizes", "1,4", "--max-tokens", "64", "--repeats", "1"]


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    out = tmp_path_factory.mktemp("t5") / "t5.json"
    argv = ["profile", "--model", "tiny-t5", "--out", str(out), "--recompute", "none,full", "--validate", "3"]
    assert main(argv + ARGS + ["--threads", "1", "--no-progress"]) == 0
    with open(out) as f:
        return json.load(f)


def test_profile_writes_the_t5_tables_format(tables):
    assert [t["recompute"] for t in tables["tables"]] == ["none", "full"]
    points = ProfileGrid(seq_lens=(16, 32), micro_batch_sizes=(1, 4), max_tokens=64).pair_points()
    assert [tuple(p) for p in tables["grid"]["points"]] == points
    t = tables["tables"][0]
    assert len(t["time_ms"]["decoder.forward"]) == len(points)
    assert {tuple(r[0]) for r in t["time_ms"]["decoder.forward"]} == {(16, 16), (16, 32), (32, 16), (32, 32)}
    assert all(r[2] > 0 for rows in t["time_ms"].values() for r in rows)
    # a layer keeps activations per token; the raw measurements of all three depths are kept
    assert all(r[2] > 0 for r in t["stored_activation_mb"]["encoder"] + t["stored_activation_mb"]["decoder"])
    assert len(tables["samples"]) == 3 * 2 * len(points)


def test_import_reads_the_cpu_profile(tables):
    cost = import_t5_tables(tables)
    assert (cost.encoder_layers, cost.decoder_layers, cost.hidden_size, cost.vocab_size) == (2, 2, 64, 8192)
    assert (cost.dtype, cost.act_bytes) == ("fp32", 4)
    assert cost.update.optimizer is not None and cost.update.optimizer[1] > 0
    assert set(cost.tables) == {("none", 1), ("full", 1)}
    # parameters: fp32 bytes back to counts (the embedding is vocabulary x d_model)
    assert cost.table("none").params["embedding"] == pytest.approx(8192 * 64)
    stage = PairStage(2, 2, embedding=True, last=True)
    c = cost.micro_batch_cost([10, 30], [5, 20], stage=stage, recompute="none")
    assert c.time_ms > 0 and c.peak_bytes >= c.stored_bytes > 0
    with pytest.raises(OutOfProfileRange):
        cost.micro_batch_cost([40], [5], stage=stage)  # longer than any measured input
    # the head's memory is the measured postprocess rows, not Megatron's loss
    head = tables["tables"][0]["stored_activation_mb"]["postprocess"]
    sd, n, mb = head[-1]
    fitted = float(linear_fit_at(cost.table("none").head["stored_bytes"], n * sd, n * sd * sd))
    assert fitted == pytest.approx(mb * MB, rel=1e-3)
    assert fitted != pytest.approx(sd * n * MEGATRON_LOSS_BYTES[0] * 8192, rel=0.05)


def test_held_out_error_recorded(tables):
    v = tables["validation"]
    assert v["count"] == 3 and v["encoder_layers"] == 2 and v["recompute"] == "none"
    assert all(c["measured_ms"] > 0 and c["predicted_ms"] > 0 for c in v["cases"])
    assert v["mape"] == pytest.approx(np.mean([c["error"] for c in v["cases"]]), abs=1e-4)


def test_regression_separates_the_components():
    """Model times built from known components at three depths: every row comes back exactly."""
    points = [(16, 16, 1), (16, 64, 4), (64, 16, 4), (64, 64, 1), (32, 128, 2), (128, 32, 2), (128, 128, 1)]
    enc, dec, head = np.array([0.5, 0.01, 1e-4]), np.array([0.3, 0.02, 2e-4, 0.005, 1e-4]), np.array([2.0, 0.05, 0.0])
    shapes = ((1, 1), (3, 1), (1, 3))

    def truth(se, sd, n):
        e = enc @ [1, n * se, n * se * se]
        d = float(decoder_terms(n, se, sd) @ dec)
        return e, d, head @ [1, n * sd, n * sd * sd]

    measured = {}
    for se, sd, n in points:
        e, d, h = truth(se, sd, n)
        for E, D in shapes:
            measured[(se, sd, n, "none", E, D)] = ((h + E * e + D * d, 2 * (h + E * e + D * d)), (0.0, 0.0))
    rows = _time_rows(measured, points, "none", shapes, 0)
    for (se, sd, n), er, dr, hr in zip(points, rows["encoder"], rows["decoder"], rows["postprocess"]):
        e, d, h = truth(se, sd, n)
        assert (er[2], dr[2], hr[2]) == pytest.approx((e, d, h), rel=1e-6)
        assert er[:2] == [se, n] and dr[:2] == [[se, sd], n] and hr[:2] == [sd, n]


@pytest.mark.parametrize("flags", [["--device", "cuda"], ["--dtype", "bf16"], ["--system-allocator"]])
def test_refusals(tmp_path, capsys, flags):
    assert main(["profile", "--model", "tiny-t5", "--out", str(tmp_path / "x.json"), *flags]) != 0
    assert "encoder-decoder" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
