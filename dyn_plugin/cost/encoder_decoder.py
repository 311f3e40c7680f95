"""Encoder-decoder (T5) costs: a micro-batch of (input, target) pairs on an encoder or decoder stage.

A micro-batch of n pairs is padded to its longest input ``Se`` and longest target ``Sd`` (each
rounded up to ``pad_multiple``: layout "padded", ``pair_shape``), or packed per side into n rows
of widths (``Se``, ``Sd``) (layout "packed", ``packed_pair_shape``), priced as n padded pairs of
those widths: the model runs each row's attention over the whole row, masked per pair. Its layers cost:

- encoder layer: the decoder-only layer's features of the input side, ``n*Se`` token slots and
  ``n*Se^2`` attention pairs (``LinearFit``, fitted as the GPT tables are: ``fit_component``);
- decoder layer: five terms, ``1, n*Sd, n*Sd^2`` (its own tokens and self-attention),
  ``n*Se`` (cross-attention keys and values projected from the encoder output) and ``n*Se*Sd``
  (cross-attention pairs): time as ``max(floor, terms @ coef)``, stored bytes as ``terms @ coef``;
  its peak is read off the measured (Se, Sd) grid per pair, linear between measured lengths along
  each side (one line over all lengths missed the peak by 10-15% on average: its transient is the
  largest of a self-attention, a cross-attention and a feed-forward buffer, which no sum follows);
- postprocess (final norm, LM head, loss) on the target side, as the GPT head.

Every decoder stage also holds the encoder output of each micro-batch in flight (it is an input
of every decoder layer's cross-attention, received from the stage before and sent on) and its
gradient while the micro-batch's backward runs.

The tables (``../shared/data/a100-measured/t5-11b.json``, bundled as
``profiles/measured/a100-t5-11b.json``) give MB as 10^6 bytes, as the GPT tables do (``measured_tables.MB``): a full-recompute decoder layer
stores its input, 8192 x 1024 x 2 bytes = 16.78 "MB", and the embedding's 82.58 "MB" at tp 1 is
(32128 + 8192) x 1024 fp16 parameters, the vocabulary and 8192 learned positions. Points outside
the measured grid are out of range (``covers``), as for GPT.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, Literal, Sequence

import numpy as np

from ..jsonfile import read_json
from .measured_tables import MB, head_sample
from .model import (
    METRICS,
    MicroBatchCost,
    OutOfProfileRange,
    Precision,
    Recompute,
    round_up,
)
from .profile import Sample, fit_component
from .table import LINEAR_HELD, LinearFit, fit_columns
from .update import StagedStates, UpdateCost

Side = Literal["encoder", "decoder"]
DECODER_TERMS = ("1", "n*Sd", "n*Sd^2", "n*Se", "n*Se*Sd")


def pair_shape(inputs: Sequence[int], targets: Sequence[int], pad_multiple: int = 8) -> tuple[int, int, int]:
    """(pairs, padded input length, padded target length) of one micro-batch."""
    if len(inputs) == 0 or len(inputs) != len(targets):
        raise ValueError(
            f"a micro-batch needs at least one pair, as many inputs as targets; got {len(inputs)} and {len(targets)}"
        )
    if min(inputs) <= 0 or min(targets) <= 0:
        raise ValueError("input and target lengths must be positive")
    return len(inputs), round_up(int(max(inputs)), pad_multiple), round_up(int(max(targets)), pad_multiple)


def packed_pair_rows(inputs: Sequence[int], targets: Sequence[int], widths: tuple[int, int]) -> list[list[int]]:
    """Positions of a packed micro-batch's pairs per row: the pairs in order, each row filled
    until the next pair would overflow its input or its target width (next fit). A packed plan
    lists its pairs row by row, so its order and widths alone say which pair shares which row:
    the rows the planner priced are the rows the runtime builds (``packed_pair_shape``)."""
    pair_shape(inputs, targets, pad_multiple=1)  # the same checks: as many positive inputs as targets
    if max(inputs) > widths[0] or max(targets) > widths[1]:
        raise ValueError(f"a pair ({max(inputs)} input, {max(targets)} target tokens) is wider than the rows {widths}")
    rows: list[list[int]] = []
    free = (0, 0)
    for k, (a, b) in enumerate(zip(inputs, targets)):
        if a > free[0] or b > free[1]:
            rows.append([])
            free = widths
        rows[-1].append(k)
        free = (free[0] - a, free[1] - b)
    return rows


def packed_pair_shape(inputs: Sequence[int], targets: Sequence[int], widths: tuple[int, int]) -> tuple[int, int, int]:
    """(rows, input width, target width) of one micro-batch of pairs packed per side (T5 packing:
    each row's inputs concatenated into one encoder row of ``widths[0]`` tokens, its targets into
    one decoder row of ``widths[1]``), rows as ``packed_pair_rows`` fills them."""
    return len(packed_pair_rows(inputs, targets, widths)), int(widths[0]), int(widths[1])


def decoder_terms(n, se, sd) -> np.ndarray:
    """[..., 5] decoder-layer terms (``DECODER_TERMS``) of micro-batches of n pairs padded to (se, sd)."""
    n, se, sd = (np.asarray(a, dtype=float) for a in (n, se, sd))
    return np.stack([np.ones_like(n * se * sd), n * sd, n * sd * sd, n * se, n * se * sd], axis=-1)


def linear_fit_at(fit: LinearFit, slots, attn) -> np.ndarray:
    """``fit`` evaluated on arrays of token slots and attention pairs (its bands by length included)."""
    slots, attn = np.asarray(slots, dtype=float), np.asarray(attn, dtype=float)
    if not fit.bands:
        c0, c1, c2 = fit.coef
        return np.maximum(fit.floor, c0 + c1 * slots + c2 * attn)
    upper, c0, c1, c2 = _band_arrays(fit)
    idx = np.searchsorted(upper, attn / slots, side="left")  # the first band whose upper length is not below
    return np.maximum(fit.floor, c0[idx] + c1[idx] * slots + c2[idx] * attn)


@lru_cache(maxsize=256)
def _band_arrays(fit: LinearFit) -> tuple[np.ndarray, ...]:
    """A banded fit's upper lengths and, per band and then beyond the last (``coef``), c0, c1, c2."""
    bands = np.array(fit.bands)
    coef = np.vstack([bands[:, 1:], np.array(fit.coef)[None, :]])
    return bands[:, 0], coef[:, 0].copy(), coef[:, 1].copy(), coef[:, 2].copy()


@dataclass(frozen=True)
class TermFit:
    """``max(floor, terms @ coef)`` over ``DECODER_TERMS``; error figures on the data it was fitted to."""

    coef: tuple[float, ...]
    floor: float = 0.0
    mape: float = 0.0
    max_ape: float = 0.0

    def __call__(self, n, se, sd) -> np.ndarray:
        c0, c1, c2, c3, c4 = self.coef  # decoder_terms, written out: no [..., 5] array per query
        return np.maximum(self.floor, c0 + n * (c1 * sd + c2 * sd * sd + c3 * se + c4 * se * sd))


@dataclass(frozen=True)
class GridFit:
    """``c0 + n * g(Se, Sd)``: ``g`` the per-pair value at the measured lengths (the median over
    micro-batch sizes above a common constant ``c0``), made non-decreasing along both sides (a longer
    input or target never holds less), linear between measured lengths along each side; below the
    shortest, the shortest's. Beyond the grid is out of range (``PairTable.covers``)."""

    enc: tuple[float, ...]
    dec: tuple[float, ...]
    values: tuple[tuple[float, ...], ...]  # [enc][dec]; NaN where not measured
    c0: float = 0.0

    def __call__(self, n, se, sd) -> np.ndarray:
        enc, dec, flat = _grid_arrays(self)
        se, sd = np.asarray(se, dtype=float), np.asarray(sd, dtype=float)
        # the measured lengths either side (the first and last cell extend beyond the grid)
        i = np.clip(np.searchsorted(enc, se) - 1, 0, max(len(enc) - 2, 0))
        j = np.clip(np.searchsorted(dec, sd) - 1, 0, max(len(dec) - 2, 0))
        i1, j1 = np.minimum(i + 1, len(enc) - 1), np.minimum(j + 1, len(dec) - 1)
        a = np.clip((se - enc[i]) / np.maximum(enc[i1] - enc[i], 1e-30), 0.0, 1.0)
        b = np.clip((sd - dec[j]) / np.maximum(dec[j1] - dec[j], 1e-30), 0.0, 1.0)
        w = len(dec)
        low = (1 - b) * flat[i * w + j] + b * flat[i * w + j1]
        high = (1 - b) * flat[i1 * w + j] + b * flat[i1 * w + j1]
        return self.c0 + np.asarray(n, dtype=float) * ((1 - a) * low + a * high)


@lru_cache(maxsize=64)
def _grid_arrays(fit: GridFit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.asarray(fit.enc), np.asarray(fit.dec), np.asarray(fit.values, dtype=float).ravel()


def fit_grid(keys: Sequence[tuple[int, int, int]], y: Sequence[float]) -> GridFit:
    """A :class:`GridFit` of values ``y`` measured at (Se, Sd, n) ``keys``."""
    k = np.asarray(keys, dtype=float)
    y = np.asarray(y, dtype=float)
    se, sd, n = k[:, 0], k[:, 1], k[:, 2]
    enc, dec = np.unique(se), np.unique(sd)
    # The constant per micro-batch from each point's line over its sizes, its largest size left out
    # (where the measurements stop, next to out of memory), as fit_banded does per length.
    intercepts = []
    for a in enc:
        for b in dec:
            at = np.flatnonzero((se == a) & (sd == b))
            at = at[np.argsort(n[at])][:-1]
            if len(np.unique(n[at])) >= 2:
                intercepts.append(np.polyfit(n[at], y[at], 1)[1])
    c0 = max(0.0, float(np.median(intercepts))) if intercepts else 0.0
    g = np.full((len(enc), len(dec)), np.nan)
    for i, a in enumerate(enc):
        for j, b in enumerate(dec):
            at = (se == a) & (sd == b)
            if at.any():
                g[i, j] = float(np.median((y[at] - c0) / n[at]))
    g = np.fmax.accumulate(np.fmax.accumulate(g, axis=0), axis=1)
    return GridFit(tuple(enc.tolist()), tuple(dec.tolist()), tuple(tuple(r) for r in g.tolist()), c0)


@dataclass(frozen=True)
class PairTable:
    """Every fit of one (recompute, tp): encoder layer, decoder layer, head; the measured range."""

    recompute: Recompute
    tp: int
    encoder: dict[str, LinearFit]
    decoder: dict[str, Any]  # forward_ms, backward_ms, stored_bytes: TermFit; peak_bytes: GridFit
    head: dict[str, LinearFit]
    params: dict[str, float]  # parameters per tensor-parallel rank: embedding, encoder, decoder (one layer)
    max_enc_len: int
    max_enc_tokens: int
    max_dec_tokens: int
    dec_len_at: tuple[tuple[int, int], ...]  # (measured input length, longest target measured with it)

    def covers(self, n, se, sd) -> np.ndarray:
        """Inside the measured range: input and target no longer, and no more tokens per side, than
        measured; the target no longer than measured at the input lengths either side of ``se``."""
        n, se, sd = (np.asarray(a, dtype=float) for a in (n, se, sd))
        lens = np.array([a for a, _ in self.dec_len_at], dtype=float)
        limit = np.array([b for _, b in self.dec_len_at], dtype=float)
        hi = np.minimum(np.searchsorted(lens, se), len(lens) - 1)
        lo = np.maximum(hi - 1, 0)
        lo = np.where(lens[hi] == se, hi, lo)
        dec_ok = sd <= np.minimum(limit[hi], limit[lo])
        return (se <= self.max_enc_len) & dec_ok & (n * se <= self.max_enc_tokens) & (n * sd <= self.max_dec_tokens)


@dataclass(frozen=True)
class PairStage:
    """One pipeline stage of an encoder-decoder model: its encoder layers, then its decoder layers
    (Megatron's split puts only one kind on a stage; one stage, pp = 1, holds both);
    ``embedding``: it holds the embedding (the first stage of each side: Megatron's T5 keeps a copy
    on the first decoder stage; one copy where both sides share a stage); ``last``: the model's
    last stage, which runs the head."""

    encoder_layers: int = 0
    decoder_layers: int = 0
    embedding: bool = False
    last: bool = False

    @property
    def held(self) -> str:
        """Its layers in words, as errors name a stage."""
        return f"{self.encoder_layers} encoder, {self.decoder_layers} decoder layers"

    @property
    def num_layers(self) -> int:
        """Its layers, of either side (a whole-stage recompute mode recomputes them all)."""
        return self.encoder_layers + self.decoder_layers

    def __post_init__(self) -> None:
        if self.encoder_layers < 0 or self.decoder_layers < 0 or self.encoder_layers + self.decoder_layers == 0:
            raise ValueError(
                f"a stage needs layers: encoder_layers={self.encoder_layers}, decoder_layers={self.decoder_layers}"
            )


@dataclass
class EncoderDecoderCostModel(StagedStates):
    """Per (recompute, tp) tables of one encoder-decoder model; the model's shape beside them."""

    name: str
    encoder_layers: int
    decoder_layers: int
    hidden_size: int
    vocab_size: int
    tables: dict[tuple[str, int], PairTable]
    dtype: str = "fp16"
    pad_multiple: int = 8
    act_bytes: int = 2  # fp16 activations between stages
    update: UpdateCost = field(default_factory=UpdateCost)
    allow_extrapolation: bool = False  # pairs are priced within the measured range only (planners ask it)
    # the online calibration's factors on every prediction (cost/online.py Calibration.apply): forward
    # time, backward time, activation bytes; as profiled (1, 1, 1) unless calibrated
    scale: tuple[float, float, float] = (1.0, 1.0, 1.0)

    def to_dict(self) -> dict:
        """Plain JSON-able form (the fits, not the measurements), for planner processes; see from_dict."""
        tables = [
            {
                **{k: getattr(t, k) for k in ("recompute", "tp", "params", "max_enc_len", "max_enc_tokens")},
                **{k: getattr(t, k) for k in ("max_dec_tokens", "dec_len_at")},
                **{side: {m: _fit_to_dict(f) for m, f in getattr(t, side).items()} for side in _SIDES},
            }
            for t in self.tables.values()
        ]
        return {
            "kind": "encoder_decoder",
            **{k: getattr(self, k) for k in ("name", "encoder_layers", "decoder_layers", "hidden_size", "vocab_size")},
            **{k: getattr(self, k) for k in ("dtype", "pad_multiple", "act_bytes")},
            "update": self.update.to_dict(),
            "tables": tables,
            **({"scale": list(self.scale)} if self.scale != (1.0, 1.0, 1.0) else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "EncoderDecoderCostModel":
        tables = {}
        for t in d["tables"]:
            fits = {side: {m: _fit_from_dict(f) for m, f in t[side].items()} for side in _SIDES}
            tables[(t["recompute"], t["tp"])] = PairTable(
                t["recompute"],
                t["tp"],
                **fits,
                params=t["params"],
                max_enc_len=t["max_enc_len"],
                max_enc_tokens=t["max_enc_tokens"],
                max_dec_tokens=t["max_dec_tokens"],
                dec_len_at=_tuples(t["dec_len_at"]),
            )
        fields = ("name", "encoder_layers", "decoder_layers", "hidden_size", "vocab_size", "dtype", "pad_multiple")
        return cls(
            **{k: d[k] for k in fields},
            tables=tables,
            act_bytes=d["act_bytes"],
            update=UpdateCost.from_dict(d["update"]),
            scale=tuple(float(x) for x in d.get("scale", (1.0, 1.0, 1.0))),
        )

    def table(self, recompute: Recompute, tp: int = 1) -> PairTable:
        if (recompute, tp) not in self.tables:
            have = ", ".join(f"{r}/tp{t}" for r, t in sorted(self.tables))
            raise OutOfProfileRange(
                f"cost model {self.name!r} has no table for recompute={recompute}, tp={tp}; it has: {have}"
            )
        return self.tables[(recompute, tp)]

    def stage_costs(
        self, stage: PairStage, n, se, sd, *, recompute: Recompute, tp: int = 1, memo: dict | None = None
    ) -> tuple[np.ndarray, ...]:
        """(forward ms, backward ms, stored bytes, peak bytes) of micro-batches of ``n`` pairs padded
        to (``se``, ``sd``) on ``stage``: arrays of the shape of ``n``, ``se`` and ``sd``. Layers run
        one at a time: the stage stores every layer's kept bytes and, at its peak, the largest
        transient among them. ``memo``: a dict kept by the caller across stages of one (n, se, sd,
        recompute, tp), so each side's layer and the head are evaluated once for all of them."""
        memo = {} if memo is None else memo
        t = self.table(recompute, tp)
        n, se, sd = (np.asarray(a, dtype=float) for a in (n, se, sd))
        fwd = bwd = stored = transient = 0.0
        for side, k in (("encoder", stage.encoder_layers), ("decoder", stage.decoder_layers)):
            if k:
                if side not in memo:
                    memo[side] = self._layer(t, side, n, se, sd)
                l_fwd, l_bwd, l_st, l_tr = memo[side]
                fwd, bwd, stored = fwd + k * l_fwd, bwd + k * l_bwd, stored + k * l_st
                transient = np.maximum(transient, l_tr)
        if stage.decoder_layers:
            # the encoder output, kept for every decoder layer's cross-attention until the stage's
            # backward ends, and its gradient summed over those layers while the backward runs
            carried = n * se * self.hidden_size * self.act_bytes
            stored, transient = stored + carried, transient + carried
        if stage.last:
            if "head" not in memo:
                memo["head"] = tuple(linear_fit_at(t.head[m], n * sd, n * sd * sd) for m in METRICS)
            h_fwd, h_bwd, h_st, h_pk = memo["head"]
            fwd, bwd, stored = fwd + h_fwd, bwd + h_bwd, stored + h_st
            transient = np.maximum(transient, h_pk - h_st)
        time_f, time_b, memory = self.scale
        return fwd * time_f, bwd * time_b, stored * memory, (stored + np.maximum(transient, 0.0)) * memory

    def _layer(self, t: PairTable, side: Side, n: np.ndarray, se: np.ndarray, sd: np.ndarray) -> tuple:
        """One layer's (forward, backward, stored, transient)."""
        if side == "encoder":
            fwd, bwd, st, pk = (linear_fit_at(t.encoder[m], n * se, n * se * se) for m in METRICS)
            return fwd, bwd, st, pk - st
        st = t.decoder["stored_bytes"](n, se, sd)
        return (
            t.decoder["forward_ms"](n, se, sd),
            t.decoder["backward_ms"](n, se, sd),
            st,
            t.decoder["peak_bytes"](n, se, sd) - st,
        )

    def split_backward_costs(
        self, stage: PairStage, n, se, sd, backward_ms, *, tp: int = 1
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Per micro-batch of ``n`` pairs padded to (``se``, ``sd``) on ``stage``: a split backward's W
        time (at most ``backward_ms``) and the bytes held from I's end until W's end; None where no
        table without recompute prices W. As the decoder-only tables' estimate (``table.weight_grad_ms``):
        a linear layer's weight gradient is one matrix multiply the size of its forward, so W is each
        layer's per-token forward terms (an encoder layer's ``n*Se``; a decoder layer's ``n*Sd``, its
        own tokens, and ``n*Se``, the cross-attention's keys and values projected from the encoder
        output; attention's pair terms have no weights) and, on the last stage, the head's forward.
        Held: each linear layer's input and output gradient, ``LINEAR_HELD`` x its parameters over
        the hidden size per token; a decoder layer's counted at ``n * max(Se, Sd)`` tokens (its
        cross-attention keys and values run over the input side: an upper bound)."""
        t = self.tables.get(("none", tp))
        if t is None:
            return None
        n, se, sd = (np.asarray(a, dtype=float) for a in (n, se, sd))
        w = np.zeros_like(n * se * sd)
        held = np.zeros_like(w)
        if stage.encoder_layers:
            enc = t.encoder["forward_ms"]
            if enc.bands:
                upper, _, c1, _ = _band_arrays(enc)
                per_token = c1[np.searchsorted(upper, se, side="left")]
            else:
                per_token = enc.coef[1]
            w += stage.encoder_layers * np.maximum(per_token, 0.0) * n * se
            held += stage.encoder_layers * t.params["encoder"] * n * se
        if stage.decoder_layers:
            _, c1, _, c3, _ = t.decoder["forward_ms"].coef
            w += stage.decoder_layers * n * (max(c1, 0.0) * sd + max(c3, 0.0) * se)
            held += stage.decoder_layers * t.params["decoder"] * n * np.maximum(se, sd)
        if stage.last:
            w += linear_fit_at(t.head["forward_ms"], n * sd, n * sd * sd)
        held *= LINEAR_HELD * self.act_bytes / self.hidden_size
        # W is priced from the forward fits, so it takes the forward's calibration
        return np.minimum(w * self.scale[0], np.asarray(backward_ms, dtype=float)), held * self.scale[2]

    def micro_batch_cost(
        self,
        inputs: Sequence[int],
        targets: Sequence[int],
        *,
        stage: PairStage,
        recompute: Recompute = "none",
        tp: int = 1,
    ) -> MicroBatchCost:
        """One micro-batch's cost on one stage; out of the measured range: :class:`OutOfProfileRange`."""
        n, se, sd = pair_shape(inputs, targets, self.pad_multiple)
        if not bool(self.table(recompute, tp).covers(n, se, sd)):
            raise OutOfProfileRange(
                f"a micro-batch of {n} pairs padded to input {se} and target {sd} is outside what cost model "
                f"{self.name!r} measured for recompute={recompute}, tp={tp}; plan smaller micro-batches or cap the lengths"
            )
        f, b, s, p = (float(x) for x in self.stage_costs(stage, n, se, sd, recompute=recompute, tp=tp))
        return MicroBatchCost(f, b, s, p)

    def link_bytes(self, stage: PairStage, n: int, se: int, sd: int, tp: int = 1) -> float:
        """What ``stage`` sends to the next one per micro-batch (its gradient comes back the same
        size): an encoder stage its hidden states (the last one: the encoder output), a decoder
        stage its hidden states and the encoder output it carries; split over the tensor-parallel
        ranks as Megatron's scatter-gather sends do."""
        tokens = n * (se + sd) if stage.decoder_layers else n * se
        return float(tokens * self.hidden_size * self.act_bytes / tp)

    def stage_params(self, stage: PairStage, tp: int = 1) -> float:
        """Parameters per tensor-parallel rank: the stage's layers, the embedding (word and learned
        positions) where it holds one, and on the last stage the output layer's copy of the word
        embeddings (tied, as Megatron's T5 keeps it: a vocabulary x hidden matrix) unless the
        embedding is there already."""
        p = self.table_params(tp)
        own = (
            p["encoder"] * stage.encoder_layers + p["decoder"] * stage.decoder_layers + p["embedding"] * stage.embedding
        )
        if stage.last and not stage.embedding:
            own += round_up(self.vocab_size, 128 * tp) * self.hidden_size / tp
        return own

    def table_params(self, tp: int) -> dict[str, float]:
        for (_, t), table in self.tables.items():
            if t == tp:
                return table.params
        raise OutOfProfileRange(f"cost model {self.name!r} has no table at tp={tp}")


_SIDES = ("encoder", "decoder", "head")
_FITS = {f.__name__: f for f in (LinearFit, TermFit, GridFit)}


def _fit_to_dict(fit: LinearFit | TermFit | GridFit) -> dict:
    return {"type": type(fit).__name__, **asdict(fit)}


def _fit_from_dict(d: dict) -> LinearFit | TermFit | GridFit:
    """A fit as ``_fit_to_dict`` wrote it: its tuples back as tuples (the fits are hashed: their
    evaluation arrays are cached per fit)."""
    d = dict(d)
    kind = _FITS[d.pop("type")]
    return kind(**{k: _tuples(v) for k, v in d.items()})


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def read_pair_tables(source: str | os.PathLike | dict[str, Any], what: str = "T5 tables") -> dict[str, Any]:
    """The encoder-decoder tables in ``source`` (a path, or already parsed): a ValueError naming
    ``what`` where the file is not JSON or holds no decoder tables of (input, target) pairs (a
    decoder-only profile, say); FileNotFoundError where it does not exist."""
    raw = source if isinstance(source, dict) else read_json(source, what)
    tables = raw.get("tables") if isinstance(raw, dict) else None
    if not isinstance(tables, list) or not any(
        isinstance(t, dict) and isinstance(t.get("time_ms"), dict) and t["time_ms"].get("decoder.forward")
        for t in tables
    ):
        where = "" if isinstance(source, dict) else f" {os.fspath(source)}"
        raise ValueError(
            f"{what}{where}: no decoder tables of (input, target) pairs (an object with 'tables' holding "
            "'decoder.forward' rows, as `dynplugin profile --model tiny-t5` writes; see the a100-measured README)"
        )
    return raw


def _points(table: dict, key: str, name: str, *, decoder: bool, pick) -> dict[tuple[int, int, int], float]:
    """(Se, Sd, n) -> value; a point measured more than once (the encoder's rows repeat for every
    target length it ran with) reduced by ``pick``. Encoder points have Sd = 0."""
    seen: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    for lens, b, v in table[key].get(name, []):
        se, sd = (int(lens[0]), int(lens[1])) if decoder else (int(lens), 0)
        seen[(se, sd, int(b))].append(float(v))
    return {k: pick(v) for k, v in seen.items()}


def _complete(table: dict, side: str) -> dict[str, dict[tuple[int, int, int], float]]:
    """A side's four metrics at the points where all four were measured (a missing one ran out of
    memory); times as the median of repeats, memory as their largest (never priced low)."""
    decoder = side == "decoder"
    got = {
        "forward_ms": _points(table, "time_ms", f"{side}.forward", decoder=decoder, pick=np.median),
        "backward_ms": _points(table, "time_ms", f"{side}.backward", decoder=decoder, pick=np.median),
        "stored_bytes": _points(table, "stored_activation_mb", side, decoder=decoder, pick=max),
        "peak_bytes": _points(table, "peak_activation_mb", side, decoder=decoder, pick=max),
    }
    keys = set.intersection(*(set(v) for v in got.values()))
    out = {m: {k: v[k] * (MB if m.endswith("bytes") else 1) for k in keys} for m, v in got.items()}
    # the peak includes what is stored (a few rows read a peak below their stored bytes)
    out["peak_bytes"] = {k: max(v, out["stored_bytes"][k]) for k, v in out["peak_bytes"].items()}
    return out


def fit_decoder(points: dict[str, dict[tuple[int, int, int], float]]) -> dict[str, Any]:
    """The decoder layer's fits from its points (``_complete``): time with a floor (small kernels
    stop shrinking), stored bytes as a plain sum of terms, peak on the grid."""
    out: dict[str, Any] = {}
    for metric in METRICS:
        keys = sorted(points[metric])
        y = np.array([points[metric][k] for k in keys])
        if metric == "peak_bytes":
            out[metric] = fit_grid(keys, y)
            continue
        X = decoder_terms(*np.array([(k[2], k[0], k[1]) for k in keys], dtype=float).T)
        coef, floor, mape, max_ape = fit_columns(X, y, floor=metric.endswith("_ms"))
        out[metric] = TermFit(tuple(float(c) for c in coef), floor, mape, max_ape)
    return out


def _encoder_samples(points, recompute: str, tp: int, component: str = "layer") -> list[Sample]:
    keys = sorted(points["forward_ms"])
    return [
        Sample(
            component=component,
            layout="padded",
            recompute=recompute,
            tp=tp,
            seq_lens=[se] * n,
            **{m: points[m][(se, sd, n)] for m in METRICS},
        )
        for se, sd, n in keys
    ]


def _head_samples(table: dict, vocab: int, recompute: str, tp: int) -> list[Sample]:
    """Postprocess rows (keyed by target length) as head samples. Memory: the table's postprocess
    rows where it measured them (a CPU profile of a tiny T5, ``profiling/pairs.py``), else priced
    as Megatron's loss holds it (``MEGATRON_LOSS_BYTES`` per token and entry of the rank's share of
    the vocabulary), as the GPT import does: the A100 tables did not measure it."""
    fwd = _points(table, "time_ms", "postprocess.forward", decoder=False, pick=np.median)
    bwd = _points(table, "time_ms", "postprocess.backward", decoder=False, pick=np.median)
    measured = "postprocess" in table["stored_activation_mb"]
    if measured:
        stored = _points(table, "stored_activation_mb", "postprocess", decoder=False, pick=max)
        peak = _points(table, "peak_activation_mb", "postprocess", decoder=False, pick=max)
    keys = fwd.keys() & bwd.keys() & (stored.keys() & peak.keys() if measured else fwd.keys())
    return [
        head_sample(
            s,
            b,
            fwd[(s, z, b)],
            bwd[(s, z, b)],
            recompute=recompute,
            tp=tp,
            vocab=vocab,
            memory_mb=(stored[(s, z, b)], peak[(s, z, b)]) if measured else None,
        )
        for s, z, b in sorted(keys)
    ]


def fit_pair_table(raw_table: dict, *, vocab: int, pad_multiple: int = 8, param_bytes: int = 2) -> PairTable:
    """Every fit of one measured (tp, recompute) table; ``param_bytes``: bytes of one parameter in
    the precision ``params_mb`` was measured in."""
    tp, rc = int(raw_table["tp"]), raw_table["recompute"]
    enc, dec = _complete(raw_table, "encoder"), _complete(raw_table, "decoder")
    if not enc["forward_ms"] or not dec["forward_ms"]:
        raise ValueError(f"T5 table tp={tp} recompute={rc}: no complete encoder or decoder rows")
    head = _head_samples(raw_table, vocab, rc, tp)
    if not head:
        raise ValueError(f"T5 table tp={tp} recompute={rc}: no postprocess rows")
    limits: dict[int, int] = defaultdict(int)
    for se, sd, _ in dec["forward_ms"]:
        limits[se] = max(limits[se], sd)
    p = raw_table["params_mb"]
    return PairTable(
        recompute=rc,
        tp=tp,
        encoder=fit_component(_encoder_samples(enc, rc, tp), "padded", pad_multiple),
        decoder=fit_decoder(dec),
        head=fit_component(head, "padded", pad_multiple),
        params={k: p[k] * MB / param_bytes for k in ("embedding", "encoder", "decoder")},
        max_enc_len=max(se for se, _, _ in enc["forward_ms"]),
        max_enc_tokens=max(se * n for se, _, n in enc["forward_ms"]),
        max_dec_tokens=max(sd * n for _, sd, n in dec["forward_ms"]),
        dec_len_at=tuple(sorted(limits.items())),
    )


# T5 11B (the artifact's model): 24 encoder and 24 decoder layers of hidden 1024, SentencePiece's 32128 entries
T5_11B = dict(encoder_layers=24, decoder_layers=24, hidden_size=1024, vocab_size=32128)


def import_t5_tables(
    source: str | os.PathLike | dict[str, Any],
    *,
    encoder_layers: int | None = None,
    decoder_layers: int | None = None,
    hidden_size: int | None = None,
    vocab_size: int | None = None,
    pad_multiple: int | None = None,
) -> EncoderDecoderCostModel:
    """The cost model fitted to measured encoder-decoder tables (the DynaPipe artifact's format).

    The model's depth, width and vocabulary: the caller's, else the file's ``model`` section (a
    profile of a tiny T5 written by ``dynplugin profile --model tiny-t5`` carries one), else T5
    11B's. The file's ``dtype`` (default fp16, the A100 tables') sets the bytes of a parameter and
    of an activation; its ``update`` (measured optimizer step and all-reduce, ``UpdateCost``) and
    ``pad_multiple`` are read where present."""
    raw = read_pair_tables(source)
    shape = {**T5_11B, **raw.get("model", {})}
    given = dict(
        encoder_layers=encoder_layers, decoder_layers=decoder_layers, hidden_size=hidden_size, vocab_size=vocab_size
    )
    shape.update({k: v for k, v in given.items() if v is not None})
    dtype = raw.get("dtype", "fp16")
    precision = Precision.of(dtype)  # refuses an unknown dtype by name
    pad = pad_multiple if pad_multiple is not None else int(raw.get("pad_multiple", 8))
    tables = {}
    for t in raw["tables"]:
        if not t["time_ms"].get("decoder.forward"):
            raise ValueError(
                f"{raw.get('name', 'tables')}: no decoder rows (tp={t['tp']}); these are decoder-only tables"
            )
        pt = fit_pair_table(t, vocab=int(shape["vocab_size"]), pad_multiple=pad, param_bytes=precision.param)
        tables[(pt.recompute, pt.tp)] = pt
    return EncoderDecoderCostModel(
        name=raw.get("name", "encoder-decoder"),
        encoder_layers=int(shape["encoder_layers"]),
        decoder_layers=int(shape["decoder_layers"]),
        hidden_size=int(shape["hidden_size"]),
        vocab_size=int(shape["vocab_size"]),
        tables=tables,
        dtype=dtype,
        pad_multiple=pad,
        act_bytes=precision.param,
        update=UpdateCost.from_dict(raw.get("update")),
    )


def held_out_pairs(source: str | os.PathLike | dict[str, Any], *, vocab_size: int = T5_11B["vocab_size"]) -> list[dict]:
    """Leave one length out, as ``measured_tables.held_out_memory`` does for GPT: per (tp,
    recompute) table, each measured input length strictly inside the measured range (encoder
    layer) and each measured (input, target) pair of lengths strictly inside it on both sides
    (decoder layer) is left out, the layer's fits refitted without it and its points predicted,
    for all four metrics. ``edge``: the largest micro-batch measured there (the next ran out of memory)."""
    rows = []
    for t in read_pair_tables(source)["tables"]:
        tp, rc = int(t["tp"]), t["recompute"]
        for side in ("encoder", "decoder"):
            pts = _complete(t, side)
            keys = sorted(pts["forward_ms"])
            groups: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)
            for k in keys:
                groups[k[:2]].append(k)
            enc_lens = sorted({k[0] for k in keys})
            dec_lens = sorted({k[1] for k in keys})
            for length, members in sorted(groups.items()):
                if not (enc_lens[0] < length[0] < enc_lens[-1]):
                    continue
                if side == "decoder" and not (dec_lens[0] < length[1] < dec_lens[-1]):
                    continue
                rest = {m: {k: v for k, v in pts[m].items() if k[:2] != length} for m in METRICS}
                largest = max(k[2] for k in members)
                if side == "encoder":
                    fits = fit_component(_encoder_samples(rest, rc, tp), "padded", 8)
                    predict = {
                        m: (lambda k, f=fits[m]: float(linear_fit_at(f, k[2] * k[0], k[2] * k[0] ** 2)))
                        for m in METRICS
                    }
                else:
                    fits = fit_decoder(rest)
                    predict = {m: (lambda k, f=fits[m]: float(f(k[2], k[0], k[1]))) for m in METRICS}
                for k in members:
                    for m in METRICS:
                        measured = pts[m][k]
                        predicted = predict[m](k)
                        rows.append(
                            {
                                "tp": tp,
                                "recompute": rc,
                                "side": side,
                                "metric": m,
                                "input_len": k[0],
                                "target_len": k[1] if side == "decoder" else None,
                                "batch": k[2],
                                "measured": measured,
                                "predicted": predicted,
                                "error": predicted / measured - 1,
                                "edge": len(members) > 1 and k[2] == largest,
                            }
                        )
    return rows
