"""Measure an encoder-decoder (T5) into per-layer tables in the A100 T5 tables' format.

The whole model runs through the real HF forward and loss (``T5ForConditionalGeneration``) on
each grid point (input length, target length, pairs), at three depths: (l1, l1), (l2, l1) and
(l1, l2) encoder and decoder layers. One regression over every point and depth separates one
encoder layer, one decoder layer and the postprocess (embeddings, final norms, LM head, loss):
model(E, D) = postprocess + E * encoder + D * decoder, each component linear in its terms (the
encoder layer's and the head's as the GPT layer's, the decoder layer's the five
``encoder_decoder.DECODER_TERMS``), as the GPT profile separates layer and head
(``cost.profile._fit_from_models``). The rows written are those components at the grid points,
keyed as ``cost.encoder_decoder.import_t5_tables`` reads them (encoder rows by input length,
decoder rows by (input, target) lengths, postprocess rows by target length), so the tiny T5 is
fitted exactly as the A100 tables are; every model's raw measurement is kept beside them
(``samples``). Timing is the GPT profiler's (``profiler.time_round_robin``: every job once per
round in random order, the minimum kept, beside the other ranks' load); memory its probe
(``profiler.memory_of``).

Memory per point: a layer's stored bytes are the difference of the models' stored bytes (exact:
allocations do not vary between runs); the postprocess keeps the rest, less the encoder output
the cost model adds to every decoder stage (``EncoderDecoderCostModel.stage_costs``). The
transient above the stored bytes is a whole-model figure (the largest of the three depths), which
each component's peak carries, as the GPT profile's does.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import numpy as np

from ..cost.encoder_decoder import PairStage, decoder_terms, import_t5_tables
from ..cost.measured_tables import MB
from ..cost.model import Precision, round_up
from ..cost.table import nnls_relative
from ..cost.update import UpdateCost
from .collective import measure_collectives
from .profiler import Job, ProfileRun, measure_jobs, memory_of, prepared
from .workload import make_pair_inputs

logger = logging.getLogger(__name__)

MIN_MS = 1e-3  # a component's least time at a point: the fits divide by what they fit (relative error)
PAD = 8


def _build(model_cfg: dict, encoder: int, decoder: int, recompute: str, seed: int):
    import torch

    from ..models.hf import build_seq2seq_lm
    from ..models.recompute import RecomputeSwitch

    torch.manual_seed(seed)
    model = build_seq2seq_lm(dict(model_cfg, num_layers=encoder, num_decoder_layers=decoder)).train()
    RecomputeSwitch(model).set(recompute)
    return model


def _depths(model_cfg: dict) -> tuple[int, int]:
    """(encoder, decoder) layers of the full model, as transformers' T5 reads the config."""
    enc = int(model_cfg["num_layers"])
    return enc, int(model_cfg.get("num_decoder_layers") or enc)


def run_pair_profile(model_cfg: dict, run: ProfileRun = ProfileRun(name="encoder-decoder")) -> dict[str, Any]:
    """Profile the encoder-decoder a HF config dict describes, on CPU in fp32; returns the tables
    file (the A100 T5 tables' format plus the model's shape, dtype, measured update and, with
    ``validate`` > 0, the held-out error: that many random micro-batches of pairs through the
    full-depth model with the first recompute mode, timed in the same rounds as the grid)."""
    if run.target is not None and (run.target.device.type, run.target.dtype) != ("cpu", "fp32"):
        raise ValueError(
            f"an encoder-decoder is profiled on CPU in fp32 only, not {run.target.device} in {run.target.dtype}"
        )
    grid = run.grid
    target = prepared(None, run.fixed_allocator, run.threads)  # CPU, fp32
    rng = np.random.default_rng(grid.seed)
    l1, l2 = grid.depths
    shapes = ((l1, l1), (l2, l1), (l1, l2))
    models = {(e, d, rc): _build(model_cfg, e, d, rc, grid.seed) for e, d in shapes for rc in grid.recomputes}
    ref = models[(l1, l1, grid.recomputes[0])]
    vocab, hidden = int(ref.config.vocab_size), int(ref.config.d_model)
    points = grid.pair_points()
    if not points:
        raise ValueError("the grid is empty: every (length x micro-batch size) exceeds --max-tokens")
    keys, jobs = [], []
    for se, sd, n in points:
        inputs = make_pair_inputs([se] * n, [sd] * n, vocab, PAD, rng)
        for rc in grid.recomputes:
            for e, d in shapes:
                keys.append((se, sd, n, rc, e, d))
                jobs.append(Job(models[(e, d, rc)], inputs))
    full_depth = _depths(model_cfg)
    held = _held_out_cases(points, run.validate, rng) if run.validate else []
    held_jobs = []
    if held:
        full = _build(model_cfg, *full_depth, grid.recomputes[0], grid.seed)
        held_jobs = [Job(full, make_pair_inputs(c["inputs"], c["targets"], vocab, PAD, rng)) for c in held]
    updated = [models[(l1, l1, grid.recomputes[0])], models[(l2, l1, grid.recomputes[0])]]
    times, optimizer = measure_jobs(model_cfg, run, target, jobs + held_jobs, updated, what="micro-batches of pairs")
    params = _param_counts(ref)
    grad_bytes = Precision.of("fp32").grad * (
        params["embedding"] + full_depth[0] * params["encoder"] + full_depth[1] * params["decoder"]
    )
    allreduce = []
    if run.ranks > 1:
        allreduce = measure_collectives(
            run.ranks, {"allreduce": [1 << 20, 4 << 20, int(grad_bytes)]}, repeats=grid.repeats, threads=run.threads
        )["allreduce"]
    measured = {k: (t, memory_of(job.model, job.inputs)) for k, job, t in zip(keys, jobs, times)}
    raw = {
        "name": run.name,
        "description": f"{run.name} measured by dynplugin profile: per-layer encoder and decoder, postprocess",
        "measured_on": target.info().model_dump(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": "dyn_plugin.profiling.pairs (depth differences of the whole HF model, fp32)",
        "row_format": "[sequence length (or [encoder length, decoder length] for decoder layers), "
        "micro-batch size, value]",
        "model": {
            "encoder_layers": full_depth[0],
            "decoder_layers": full_depth[1],
            "hidden_size": hidden,
            "vocab_size": vocab,
            "config": model_cfg,
        },
        "dtype": "fp32",
        "pad_multiple": PAD,
        "ranks": run.ranks,
        "grid": {"points": [list(p) for p in points], "depths": [l1, l2], "repeats": grid.repeats},
        "update": UpdateCost.fit(optimizer, allreduce or None, run.ranks).to_dict(),
        "samples_format": "[input length, target length, pairs, recompute, encoder layers, decoder layers, "
        "forward ms, backward ms, stored bytes, peak bytes]",
        "samples": [[*k, *t, *m] for k, (t, m) in measured.items()],
        "tables": [
            _table(measured, points, rc, l1, l2, params, hidden * Precision.of("fp32").param) for rc in grid.recomputes
        ],
    }
    if held:
        raw["validation"] = _score(raw, held, times[len(jobs) :], grid.recomputes[0], full_depth)
    return raw


def _terms(se, sd, n) -> dict[str, np.ndarray]:
    """Each component's terms at a point: the encoder layer's (``1, n*Se, n*Se^2``, the GPT layer's
    over the input side), the decoder layer's (``encoder_decoder.DECODER_TERMS``) and the
    postprocess's (the GPT head's over the target side)."""
    return {
        "encoder": np.array([1.0, n * se, n * se * se]),
        "decoder": decoder_terms(n, se, sd),
        "postprocess": np.array([1.0, n * sd, n * sd * sd]),
    }


def _time_rows(measured: dict, points, rc: str, shapes, pass_: int) -> dict[str, list]:
    """One pass's (0 forward, 1 backward) rows of every component at every point, from one
    regression over every point and depth: model(E, D) = postprocess + E * encoder + D * decoder,
    non-negative coefficients, in relative error. Pooling averages out the timing noise that a
    per-point difference of two models would amplify (on a loaded CPU it left layers at zero)."""
    X, y = [], []
    for se, sd, n in points:
        t = _terms(se, sd, n)
        for e, d in shapes:
            X.append(np.concatenate([t["postprocess"], e * t["encoder"], d * t["decoder"]]))
            y.append(measured[(se, sd, n, rc, e, d)][0][pass_])
    coef = nnls_relative(np.array(X), np.array(y))
    parts = {"postprocess": coef[:3], "encoder": coef[3:6], "decoder": coef[6:]}
    rows: dict[str, list] = {c: [] for c in parts}
    for se, sd, n in points:
        t = _terms(se, sd, n)
        value = {c: max(float(t[c] @ parts[c]), MIN_MS) for c in parts}
        rows["encoder"].append([se, n, value["encoder"]])
        rows["decoder"].append([[se, sd], n, value["decoder"]])
        rows["postprocess"].append([sd, n, value["postprocess"]])
    return rows


def _table(measured: dict, points, rc: str, l1: int, l2: int, params: dict, act_bytes_per_token: int) -> dict:
    """One recompute mode's table: per point, one encoder layer, one decoder layer, the postprocess."""
    delta = l2 - l1
    shapes = ((l1, l1), (l2, l1), (l1, l2))
    time_ms = {}
    for i, p in enumerate(("forward", "backward")):
        for c, rows in _time_rows(measured, points, rc, shapes, i).items():
            time_ms[f"{c}.{p}"] = rows
    stored = {c: [] for c in ("encoder", "decoder", "postprocess")}
    peak = {c: [] for c in stored}
    for se, sd, n in points:
        (_, m11), (_, m21), (_, m12) = (measured[(se, sd, n, rc, e, d)] for e, d in shapes)
        enc_st = max(m21[0] - m11[0], 0.0) / delta
        dec_st = max(m12[0] - m11[0], 0.0) / delta
        carried = n * se * act_bytes_per_token  # the encoder output, priced on decoder stages
        head_st = max(m11[0] - l1 * (enc_st + dec_st) - carried, 0.0)
        transient = max(m[1] - m[0] for m in (m11, m21, m12))
        for c, st, key in (("encoder", enc_st, se), ("decoder", dec_st, [se, sd]), ("postprocess", head_st, sd)):
            stored[c].append([key, n, st / MB])
            peak[c].append([key, n, (st + transient) / MB])
    return {
        "tp": 1,
        "recompute": rc,
        "time_ms": time_ms,
        "stored_activation_mb": stored,
        "peak_activation_mb": peak,
        "params_mb": {k: params[k] * Precision.of("fp32").param / MB for k in ("embedding", "encoder", "decoder")},
    }


def _param_counts(model) -> dict[str, float]:
    """Parameters of the shared embedding and of one encoder and one decoder layer (the second
    block where there is one: T5's first block of each side also holds the relative position bias)."""
    enc, dec = model.encoder.block, model.decoder.block
    count = lambda m: float(sum(p.numel() for p in m.parameters()))  # noqa: E731
    return {
        "embedding": count(model.get_input_embeddings()),
        "encoder": count(enc[min(1, len(enc) - 1)]),
        "decoder": count(dec[min(1, len(dec) - 1)]),
    }


def _held_out_cases(points, count: int, rng: np.random.Generator) -> list[dict]:
    """Random micro-batches of pairs inside the measured range: lengths log-uniform per side (so
    short and long both appear, each pair's two sides apart), the pairs as many as the largest
    measured micro-batch at the padded lengths allows on both sides."""
    longest = max(max(se, sd) for se, sd, _ in points)
    cases = []
    while len(cases) < count:
        size = int(rng.integers(1, max(n for *_, n in points) + 1))
        lens = np.exp(rng.uniform(np.log(2), np.log(longest), size=(size, 2))).astype(int)
        se, sd = (round_up(int(lens[:, i].max()), PAD) for i in (0, 1))
        # the largest measured micro-batch at least as long on both sides bounds this one
        fits = [n for a, b, n in points if a >= se and b >= sd]
        if fits and size <= max(fits):
            cases.append({"inputs": lens[:, 0].tolist(), "targets": lens[:, 1].tolist()})
    return cases


def _score(raw: dict, cases: list[dict], times, recompute: str, depth: tuple[int, int]) -> dict:
    """Each held-out micro-batch's measured step (forward + backward) against the cost model's
    price of the whole model on one stage."""
    cost = import_t5_tables(raw)
    stage = PairStage(depth[0], depth[1], embedding=True, last=True)
    scored = []
    for case, (fwd, bwd) in zip(cases, times):
        m = fwd + bwd
        p = cost.micro_batch_cost(case["inputs"], case["targets"], stage=stage, recompute=recompute).time_ms
        scored.append(
            {**case, "measured_ms": round(m, 3), "predicted_ms": round(p, 3), "error": round(abs(p - m) / m, 4)}
        )
    errors = [c["error"] for c in scored]
    return {
        "recompute": recompute,
        "encoder_layers": depth[0],
        "decoder_layers": depth[1],
        "count": len(scored),
        "mape": float(np.mean(errors)) if errors else None,
        "max_ape": float(np.max(errors)) if errors else None,
        "cases": scored,
    }
