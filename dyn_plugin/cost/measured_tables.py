"""Import per-layer cost tables measured elsewhere (the DynaPipe artifact's format) as a profile.

The format (../shared/data/a100-measured/README.md): per (tp, recompute) table, rows of
``[sequence length, micro-batch size, value]`` for ``time_ms["encoder.forward"|...]``,
``stored_activation_mb``, ``peak_activation_mb`` and ``params_mb``. Each (s, b) with all four
layer values becomes a padded ``layer`` sample; postprocess rows become ``head`` samples.

Two documented assumptions, both recorded in the profile's ``grid``:

- packed micro-batches cost what the padded fit predicts for their features (tokens and
  sum(s_i^2)): true of varlen attention kernels, which the tables' Megatron layers are
  comparable to per token; the tables themselves hold padded batches only;
- MB means 10^6 bytes (a GPT-6.7B layer's 201.4 million fp16 weights are its 402.77 ``params_mb``;
  the T5 tables agree, encoder_decoder.py); the head's memory was not measured: it is priced as
  Megatron's loss holds it (``MEGATRON_LOSS_BYTES`` per token and entry of the rank's share of the vocabulary).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Any

from .model import MEGATRON_LOSS_BYTES, features
from .profile import SCHEMA, VERSION, DeviceInfo, ModelInfo, Profile, Sample, fit_component, fit_tables

MB = 10**6  # the artifact's unit (module docstring)
# Attention heads of the artifact's models (its Megatron configs; the tables do not say):
# GPT 6.7B: 32 heads of 128 over hidden 4096; T5 11B: 128 heads of 128 (d_kv) over hidden 1024.
HEADS = {"gpt-6.7b": 32, "t5-11b": 128}
# Their vocabularies (GPT-2's BPE padded to a multiple of 128, T5's SentencePiece), which size the head's loss.
VOCAB = {"gpt-6.7b": 50304, "t5-11b": 32128}


def head_sample(
    s: int,
    rows: int,
    forward_ms: float,
    backward_ms: float,
    *,
    recompute: str,
    tp: int,
    vocab: int,
    memory_mb: tuple[float, float] | None = None,
) -> Sample:
    """The head (output layer and loss) on ``rows`` padded rows of ``s`` tokens, from a measured
    table's row: its memory as the table measured it (``memory_mb``: stored, peak), else as
    Megatron's loss holds it (``MEGATRON_LOSS_BYTES`` per token and entry of the rank's share of
    the vocabulary), which the A100 tables did not measure. The GPT and T5 imports share it."""
    if memory_mb is None:
        stored, peak = (s * rows * loss * vocab / tp for loss in MEGATRON_LOSS_BYTES)
    else:
        stored, peak = memory_mb[0] * MB, max(memory_mb) * MB
    return Sample(
        component="head",
        layout="padded",
        recompute=recompute,
        tp=tp,
        seq_lens=[s] * rows,
        forward_ms=forward_ms,
        backward_ms=backward_ms,
        stored_bytes=stored,
        peak_bytes=peak,
    )


def _rows(table: dict[str, Any], key: str, name: str) -> dict[tuple[int, int], float]:
    return {(int(s), int(b)): float(v) for s, b, v in table[key].get(name, [])}


def import_measured_tables(
    source: str | os.PathLike | dict[str, Any],
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    vocab_size: int | None = None,
) -> Profile:
    """The tables hold one layer; the model's depth and width come from the caller, and so do its
    attention heads and vocabulary (default: those of the artifact's models by table name, else
    unknown heads and the embedding's rows)."""
    if isinstance(source, dict):
        raw = source
    else:
        with open(source) as f:
            raw = json.load(f)
    where = raw.get("name", "measured tables") if isinstance(raw, dict) else str(source)
    if not isinstance(raw, dict) or "tables" not in raw:
        raise ValueError(f"{where}: expected an object with 'tables' (see the a100-measured README)")
    samples: list[Sample] = []
    params = None
    vocab = vocab_size or VOCAB.get(raw.get("name")) or _embedding_rows(raw, hidden_size)
    for t in raw["tables"]:
        tp, rc = int(t["tp"]), t["recompute"]
        fwd = _rows(t, "time_ms", "encoder.forward")
        bwd = _rows(t, "time_ms", "encoder.backward")
        stored = _rows(t, "stored_activation_mb", "encoder")
        peak = _rows(t, "peak_activation_mb", "encoder")
        # Only points with every value: a missing one was not measured (out of memory), not free.
        for key in sorted(fwd.keys() & bwd.keys() & stored.keys() & peak.keys()):
            s, b = key
            samples.append(
                Sample(
                    component="layer",
                    layout="padded",
                    recompute=rc,
                    tp=tp,
                    seq_lens=[s] * b,
                    forward_ms=fwd[key],
                    backward_ms=bwd[key],
                    stored_bytes=stored[key] * MB,
                    peak_bytes=max(peak[key], stored[key]) * MB,
                )
            )
        hf, hb = _rows(t, "time_ms", "postprocess.forward"), _rows(t, "time_ms", "postprocess.backward")
        for key in sorted(hf.keys() & hb.keys()):
            samples.append(head_sample(*key, hf[key], hb[key], recompute=rc, tp=tp, vocab=vocab))
        if tp == 1 and params is None:
            # fp16 parameters: 2 bytes each. The LM head shares the embedding's weights.
            emb = t["params_mb"]["embedding"] * MB / 2
            params = {"embedding": emb, "layer": t["params_mb"]["encoder"] * MB / 2, "head": emb}
    if not samples or params is None:
        raise ValueError(f"{where}: no complete rows (need encoder forward/backward/stored/peak at tp=1)")
    return Profile(
        schema=SCHEMA,
        version=VERSION,
        created="",
        model=ModelInfo(
            name=raw.get("name", "imported"),
            num_layers=num_layers,
            hidden_size=hidden_size,
            num_heads=num_heads or HEADS.get(raw.get("name")),
            num_kv_heads=num_kv_heads,
            params=params,
            dtype="fp16",
            config={"description": raw.get("description", "")},
        ),
        device=DeviceInfo(type="gpu", name=raw.get("measured_on", "unknown").split(",")[0]),
        grid={
            "source": raw.get("source", ""),
            "memory_unit": "MB = 10^6 bytes; head memory priced from the vocabulary, not measured",
        },
        packed_from_padded=True,
        samples=samples,
        tables=fit_tables(samples),
    )


def _embedding_rows(raw: dict[str, Any], hidden_size: int) -> int:
    """The embedding's rows from its fp16 parameters at tp=1: the vocabulary, or more where the
    embedding holds learned positions too (then the head is priced high, never low)."""
    for t in raw["tables"]:
        if int(t["tp"]) == 1 and "embedding" in t.get("params_mb", {}):
            return round(t["params_mb"]["embedding"] * MB / 2 / hidden_size)
    raise ValueError("measured tables: no tp=1 table with params_mb.embedding (the vocabulary prices the head)")


def held_out_memory(profile: Profile, pad_multiple: int = 8) -> list[dict[str, Any]]:
    """Leave one length out: per (tp, recompute) table and per measured sequence length strictly
    inside the measured range, the layer's memory fits refitted without that length's points,
    then its points predicted (interpolation across lengths, the case plans with unmeasured
    lengths rely on). One row per point and metric. ``edge``: the largest micro-batch measured
    at its length, where the measurement stopped (next size out of memory); the allocator's
    behaviour there is its own question (issue 24, the measured margin), so it is reported apart."""
    groups: dict[tuple[int, str], list[Sample]] = defaultdict(list)
    for s in profile.samples:
        if s.component == "layer":
            groups[(s.tp, s.recompute)].append(s)
    rows = []
    for (tp, rc), samples in sorted(groups.items()):
        by_len: dict[int, list[Sample]] = defaultdict(list)
        for s in samples:
            by_len[s.seq_lens[0]].append(s)
        for length in sorted(by_len)[1:-1]:
            fits = fit_component([s for s in samples if s.seq_lens[0] != length], "padded", pad_multiple)
            largest = max(len(s.seq_lens) for s in by_len[length])
            for s in by_len[length]:
                f = features(s.seq_lens, "padded", pad_multiple)
                for metric in ("stored_bytes", "peak_bytes"):
                    measured = getattr(s, metric)
                    rows.append(
                        {
                            "tp": tp,
                            "recompute": rc,
                            "metric": metric,
                            "seq_len": length,
                            "batch": len(s.seq_lens),
                            "measured_mb": measured / MB,
                            "predicted_mb": fits[metric](f) / MB,
                            "error": fits[metric](f) / measured - 1,
                            "edge": len(by_len[length]) > 1 and len(s.seq_lens) == largest,
                        }
                    )
    return rows
