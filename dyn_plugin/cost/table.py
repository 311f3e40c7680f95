"""Cost tables: the one representation both cost models reduce to, evaluated natively.

Every quantity of one component (embedding, transformer layer, head) is linear in the two
micro-batch features: ``y = c0 + c1*tokens + c2*attn``. The analytic model derives the
coefficients from FLOPs and bytes; the fitted model from measurements. Because the form is
fixed, the C++ planners evaluate it without calling back into Python.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from .model import (
    COMPONENTS,
    METRICS,
    Features,
    Layout,
    MicroBatchCost,
    OutOfProfileRange,
    Recompute,
    StageSpec,
    features,
)
from .native import core
from .sequence_parallel import SequenceParallelCost
from .update import StagedStates, UpdateCost

logger = logging.getLogger(__name__)


Band = tuple[float, float, float, float]  # (upper length, c0, c1, c2)


@dataclass(frozen=True)
class LinearFit:
    """``max(floor, c0 + c1*tokens + c2*attn)``; error figures are on the data it was fitted to.

    The floor is what a GPU takes for any small kernel: below some size time stops shrinking.

    ``bands`` make it piecewise in the micro-batch's length ``attn / tokens`` (a padded row's
    length, a packed row's token-weighted mean length): the first band whose upper length is not
    below it gives the coefficients, ``coef`` serves beyond the last. Activation memory needs it:
    its transient is the larger of a per-token and a per-pair term, which no single line follows.
    """

    coef: tuple[float, float, float]
    mape: float = 0.0  # mean absolute percentage error of the fit
    max_ape: float = 0.0
    n: int = 0
    floor: float = 0.0
    bands: tuple[Band, ...] = ()

    def __call__(self, f: Features) -> float:
        c0, c1, c2 = self.coef_at(f.attn / f.slots) if self.bands else self.coef
        return max(self.floor, c0 + c1 * f.slots + c2 * f.attn)

    def coef_at(self, length: float) -> tuple[float, float, float]:
        """The (c0, c1, c2) that price a micro-batch of length ``attn / slots``: its band's, else ``coef``."""
        return next((tuple(b[1:]) for b in self.bands if length <= b[0]), self.coef)

    def map_terms(self, fn: Callable[[tuple[float, float, float]], tuple[float, float, float]]) -> "LinearFit":
        """The same fit with ``fn`` applied to the coefficients of every band."""
        return replace(self, coef=fn(self.coef), bands=tuple((b[0], *fn(b[1:])) for b in self.bands))


@dataclass(frozen=True)
class CostTable:
    """Fits of every metric of every component for one (layout, recompute, tp)."""

    layout: Layout
    recompute: Recompute
    tp: int
    fits: dict[str, dict[str, LinearFit]]  # component -> metric -> fit
    max_tokens: float = float("inf")  # measured range of one micro-batch
    max_len: float = float("inf")

    def covers(self, tokens: float, longest: float) -> bool:
        """Inside the measured range: no more tokens and no longer sequence than measured."""
        return tokens <= self.max_tokens and longest <= self.max_len

    def coef_array(self) -> np.ndarray:
        """[component, metric, 4] = (c0, c1, c2, floor), the layout the C++ evaluator takes."""
        return np.array(
            [[(*self.fits[c][m].coef, self.fits[c][m].floor) for m in METRICS] for c in COMPONENTS],
            dtype=np.float64,
        )

    def band_array(self) -> np.ndarray:
        """[component, metric, most bands, 4] = (upper length, c0, c1, c2) for the C++ evaluator;
        fits with fewer bands are filled with rows of upper length -inf, which never apply."""
        k = max((len(self.fits[c][m].bands) for c in COMPONENTS for m in METRICS), default=0)
        out = np.zeros((len(COMPONENTS), len(METRICS), k, 4))
        out[..., 0] = -np.inf
        for i, c in enumerate(COMPONENTS):
            for j, m in enumerate(METRICS):
                for r, band in enumerate(self.fits[c][m].bands):
                    out[i, j, r] = band
        return out


def nnls_relative(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares in relative error: min sum(((X c - y) / y)^2), c >= 0.

    Relative error because 5 ms matter on a 10 ms micro-batch and not on a 2 s one. With at
    most a handful of unknowns the exact answer is a search over all active sets.
    """
    y = np.asarray(y, dtype=np.float64)
    X = np.asarray(X, dtype=np.float64)
    if len(y) == 0:
        raise ValueError("cannot fit a cost table without measurements")
    if np.any(y <= 0):
        raise ValueError("measurements must be positive to fit in relative error")
    Xw, yw = X / y[:, None], np.ones_like(y)
    k = X.shape[1]
    best, best_err = np.zeros(k), np.inf
    for mask in range(1, 1 << k):
        cols = [i for i in range(k) if mask >> i & 1]
        sol, *_ = np.linalg.lstsq(Xw[:, cols], yw, rcond=None)
        if np.any(sol < 0):
            continue
        coef = np.zeros(k)
        coef[cols] = sol
        err = float(np.sum((Xw @ coef - yw) ** 2))
        if err < best_err:
            best, best_err = coef, err
    return best


def fit_error(pred: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(mean, max) absolute percentage error."""
    ape = np.abs(np.asarray(pred) - y) / y
    return float(ape.mean()), float(ape.max())


def fit_linear(tokens: np.ndarray, attn: np.ndarray, y: np.ndarray, *, floor: bool = False) -> LinearFit:
    """``y = c0 + c1*tokens + c2*attn`` with non-negative coefficients; with ``floor``, also
    ``max(floor, ...)`` where that fits better (see :func:`fit_columns`)."""
    y = np.asarray(y, dtype=float)
    X = np.stack([np.ones(len(y)), np.asarray(tokens, float), np.asarray(attn, float)], axis=1)
    coef, f, mape, max_ape = fit_columns(X, y, floor=floor)
    return LinearFit(tuple(float(c) for c in coef), mape, max_ape, len(y), floor=f)


def fit_columns(X: np.ndarray, y: np.ndarray, *, floor: bool = False) -> tuple[np.ndarray, float, float, float]:
    """``y = X @ coef`` with non-negative coefficients, in relative error; with ``floor``, also
    ``max(floor, X @ coef)`` where that fits better (the floor is tried at the smallest measured
    values and the line fitted to the points above it). Returns (coef, floor, mean, max absolute
    percentage error); any number of columns (the encoder-decoder fits have five)."""
    y = np.asarray(y, dtype=float)
    X = np.asarray(X, dtype=float)
    coef = nnls_relative(X, y)
    best = (float(np.sum(((X @ coef - y) / y) ** 2)), 0.0, coef)
    if floor:
        low = np.unique(np.sort(y)[: max(1, len(y) // 2)])
        for f in low[np.linspace(0, len(low) - 1, min(len(low), 16)).astype(int)]:
            above = y > 1.02 * f
            if above.sum() < 3:
                continue
            c = nnls_relative(X[above], y[above])
            err = float(np.sum((np.maximum(f, X @ c) - y) ** 2 / y**2))
            if err < best[0]:
                best = (err, float(f), c)
    _, f, coef = best
    return (coef, f, *fit_error(np.maximum(f, X @ coef), y))


def fit_banded(tokens: np.ndarray, attn: np.ndarray, y: np.ndarray) -> LinearFit:
    """Activation memory interpolated over the measured lengths instead of one curve over all.

    Per measured length ``L = attn / tokens`` the memory per token ``g(L)`` (median over its
    micro-batch sizes, above a common per-micro-batch constant), then ``tokens * g`` with ``g``
    linear between neighbouring lengths: per band exactly ``c0 + c1*tokens + c2*attn``. ``g`` is
    made non-decreasing and convex: per token, a longer sequence keeps at least as much, and its
    growth never slows (the attention term grows with the length, the per-token term does not
    shrink), so a measured drop or bend (lengths measured at one size only, next to out of
    memory; two lengths at tp 1 read the same 15,650 MB) is not trusted. Below the shortest length ``g`` stays at its value there; beyond the longest the last
    band's line continues, never below the last measured slope. One length only: a plain line.
    """
    tokens, attn, y = (np.asarray(a, dtype=float) for a in (tokens, attn, y))
    length = np.round(attn / tokens, 6)
    lengths = np.unique(length)
    if len(lengths) < 2:
        return fit_linear(tokens, attn, y)
    # The constant per micro-batch, from each length's line over its sizes; its largest size is
    # left out there (where the measurements stop, next to out of memory, memory bends away).
    intercepts = []
    for L in lengths:
        at = np.flatnonzero(length == L)
        at = at[np.argsort(tokens[at])][:-1]
        if len(np.unique(tokens[at])) >= 2:
            intercepts.append(np.polyfit(tokens[at], y[at], 1)[1])
    c0 = max(0.0, float(np.median(intercepts))) if intercepts else 0.0
    per_token = np.maximum.accumulate([float(np.median((y[length == L] - c0) / tokens[length == L])) for L in lengths])
    for k in range(2, len(lengths)):
        slope = (per_token[k - 1] - per_token[k - 2]) / (lengths[k - 1] - lengths[k - 2])
        per_token[k] = max(per_token[k], per_token[k - 1] + slope * (lengths[k] - lengths[k - 1]))
    bands: list[Band] = [(float(lengths[0]), c0, float(per_token[0]), 0.0)]
    for (a, b), (ga, gb) in zip(zip(lengths, lengths[1:]), zip(per_token, per_token[1:])):
        slope = float((gb - ga) / (b - a))
        bands.append((float(b), c0, float(ga - slope * a), slope))
    fit = LinearFit(bands[-1][1:], bands=tuple(bands))
    pred = np.array([fit(Features(t, a, 0)) for t, a in zip(tokens, attn)])
    return replace(fit, mape=fit_error(pred, y)[0], max_ape=fit_error(pred, y)[1], n=len(y))


@dataclass
class TableCostModel(StagedStates):
    """A :class:`~dyn_plugin.cost.model.CostModel` over cost tables.

    ``allow_extrapolation``: queries beyond the measured micro-batch size are an
    :class:`OutOfProfileRange` error by default, or a cost flagged ``extrapolated``.
    """

    name: str
    num_layers: int
    tables: dict[tuple[str, str, int], CostTable]
    params: dict[str, float]  # component -> parameter count (tp=1)
    dtype: str = "bf16"
    pad_multiple: int = 8
    allow_extrapolation: bool = False
    hidden_size: int | None = None  # sizes the activations sent between pipeline stages
    update: UpdateCost = field(default_factory=UpdateCost)  # gradient all-reduce + optimizer step
    # attention heads decide Ulysses or ring and size the sequence-parallel collectives
    num_heads: int | None = None
    num_kv_heads: int | None = None  # None: as many as query heads
    collectives: SequenceParallelCost = field(default_factory=SequenceParallelCost)
    # C++ tables, built on first use; not an init field, so every dataclasses.replace() copy (another
    # pad_multiple, extrapolation allowed) builds its own instead of sharing the original's
    _native: dict = field(default_factory=dict, repr=False, init=False, compare=False)

    def to_dict(self) -> dict:
        """Plain JSON-able form (coefficients only), e.g. for planner processes; see from_dict."""
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "params": self.params,
            "dtype": self.dtype,
            "pad_multiple": self.pad_multiple,
            "allow_extrapolation": self.allow_extrapolation,
            "hidden_size": self.hidden_size,
            "update": self.update.to_dict(),
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "collectives": self.collectives.to_dict(),
            "tables": [
                {
                    "layout": t.layout,
                    "recompute": t.recompute,
                    "tp": t.tp,
                    "max_tokens": t.max_tokens,
                    "max_len": t.max_len,
                    "fits": {
                        c: {m: [*f.coef, f.floor, *(x for b in f.bands for x in b)] for m, f in ms.items()}
                        for c, ms in t.fits.items()
                    },
                }
                for t in self.tables.values()
            ],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "TableCostModel":
        tables = {}
        for t in d["tables"]:
            fits = {
                c: {
                    m: LinearFit(
                        tuple(v[:3]), floor=v[3], bands=tuple(tuple(v[i : i + 4]) for i in range(4, len(v), 4))
                    )
                    for m, v in ms.items()
                }
                for c, ms in t["fits"].items()
            }
            tables[(t["layout"], t["recompute"], t["tp"])] = CostTable(
                t["layout"], t["recompute"], t["tp"], fits, t["max_tokens"], t["max_len"]
            )
        return cls(
            name=d["name"],
            num_layers=d["num_layers"],
            tables=tables,
            params=d["params"],
            dtype=d["dtype"],
            pad_multiple=d["pad_multiple"],
            allow_extrapolation=d["allow_extrapolation"],
            hidden_size=d["hidden_size"],
            update=UpdateCost.from_dict(d.get("update")),
            num_heads=d.get("num_heads"),
            num_kv_heads=d.get("num_kv_heads"),
            collectives=SequenceParallelCost.from_dict(d.get("collectives")),
        )

    def with_pad_multiple(self, pad_multiple: int) -> "TableCostModel":
        """The same model pricing padded micro-batches rounded up to ``pad_multiple``: the
        rounding the runtime pads to (``microbatching.pad_multiple``), which may differ from the
        one the profile was measured with; the fits are per token slot, so they carry over."""
        if pad_multiple < 1:
            raise ValueError(f"pad_multiple must be >= 1; got {pad_multiple}")
        if pad_multiple == self.pad_multiple:
            return self
        return replace(self, pad_multiple=pad_multiple)

    def table(self, layout: Layout, recompute: Recompute, tp: int = 1) -> CostTable:
        key = (layout, recompute, tp)
        if key not in self.tables:
            have = ", ".join(f"{l}/{r}/tp{t}" for l, r, t in sorted(self.tables))
            raise OutOfProfileRange(
                f"cost model {self.name!r} has no table for layout={layout}, recompute={recompute}, "
                f"tp={tp}; it has: {have}"
            )
        return self.tables[key]

    def native(self, layout: Layout, recompute: Recompute, tp: int = 1):
        """The C++ evaluator of one table (None without the extension)."""
        if core is None:
            return None
        key = (layout, recompute, tp)
        if key not in self._native:
            t = self.table(layout, recompute, tp)
            # with extrapolation allowed every query is in range (the Python side flags it)
            unbounded = float("inf") if self.allow_extrapolation else None
            self._native[key] = core.CostTable(
                t.coef_array(),
                layout == "packed",
                self.pad_multiple,
                unbounded or t.max_tokens,
                unbounded or t.max_len,
                t.band_array(),
            )
        return self._native[key]

    def micro_batch_cost(
        self,
        seq_lens: Sequence[int],
        *,
        layout: Layout,
        recompute: Recompute = "none",
        tp: int = 1,
        stage: StageSpec | None = None,
    ) -> MicroBatchCost:
        stage = stage or StageSpec(self.num_layers)
        t = self.table(layout, recompute, tp)
        f = features(seq_lens, layout, self.pad_multiple)
        extrapolated = not t.covers(f.slots, f.max_len)
        if extrapolated and not self.allow_extrapolation:
            raise OutOfProfileRange(
                f"micro-batch of {len(seq_lens)} sequences ({int(f.slots)} tokens, longest "
                f"{f.max_len}) is outside what cost model {self.name!r} measured for "
                f"{layout}/{recompute}/tp{tp} (max {int(t.max_tokens)} tokens, longest "
                f"{int(t.max_len)}); profile larger micro-batches or allow extrapolation"
            )
        return evaluate_stage(t, f, stage, extrapolated)

    def stage_params(self, stage: StageSpec | None = None, tp: int = 1) -> float:
        stage = stage or StageSpec(self.num_layers)
        return (
            self.params["layer"] * stage.num_layers / tp
            + self.params["embedding"] * stage.first
            + self.params["head"] * stage.last
        )

    @property
    def kv_hidden_size(self) -> int | None:
        """Width of the keys (and of the values): hidden size scaled by key/value over query heads."""
        if self.hidden_size is None or not self.num_heads or not self.num_kv_heads:
            return self.hidden_size
        return self.hidden_size * self.num_kv_heads // self.num_heads


def evaluate_stage(t: CostTable, f: Features, stage: StageSpec, extrapolated: bool = False) -> MicroBatchCost:
    """Sum the components a stage holds; peak = all stored bytes + the worst transient.

    The pure-Python twin of ``CostTable::stage_cost`` in csrc/cost_table.hpp.
    """
    counts = {"embedding": int(stage.first), "layer": stage.num_layers, "head": int(stage.last)}
    fwd = bwd = stored = transient = 0.0
    for comp, k in counts.items():
        if k == 0:
            continue
        fit = t.fits[comp]
        fwd += k * fit["forward_ms"](f)
        bwd += k * fit["backward_ms"](f)
        s = fit["stored_bytes"](f)
        stored += k * s
        transient = max(transient, fit["peak_bytes"](f) - s)
    return MicroBatchCost(fwd, bwd, stored, stored + max(transient, 0.0), extrapolated)


# values a token holds per layer between a split backward's I and W, per weight over the hidden
# size: each linear layer's input and output gradient (pricing.split_backward_costs says why 4/3)
LINEAR_HELD = 4 / 3


def weight_grad_ms(t: CostTable, f: Features, stage: StageSpec) -> float:
    """Of a stage's backward, the part that computes weight gradients (W, when the backward is split).

    Measured where the profile timed it (``weight_ms``: the profiler runs W apart). Else priced
    from the forward, which the fits separate: a linear layer's weight gradient is one matrix
    multiply the size of its forward one, and a layer's forward is a per-token term (its matrix
    multiplies, with the element-wise work beside them) plus a per-pair term (attention, which has
    no weights), so W is at most each layer's per-token forward term and the head's forward (on a
    CPU that bound was 1.8x the measured W). The embedding's gradient (a scatter) stays with I."""
    if "weight_ms" in t.fits["layer"]:
        w = stage.num_layers * t.fits["layer"]["weight_ms"](f)
        return w + (t.fits["head"]["weight_ms"](f) if stage.last else 0.0)
    layer = t.fits["layer"]["forward_ms"]
    _, per_token, _ = layer.coef_at(f.attn / f.slots) if layer.bands else layer.coef
    w = stage.num_layers * max(0.0, per_token * f.slots)
    if stage.last and "head" in t.fits:
        w += t.fits["head"]["forward_ms"](f)
    return w


def evaluate_checkpointed(
    t: CostTable, plain: CostTable, f: Features, stage: StageSpec, checkpointed: int, extrapolated: bool = False
) -> MicroBatchCost:
    """A stage where ``checkpointed`` of its layers run under ``t``'s recompute mode and the rest
    under ``plain`` (no recompute): pyramid checkpointing. Per-layer costs add, so the stage costs
    the two parts' sum; its peak holds both parts' stored bytes and the larger transient. The
    embedding and head stay priced with ``t``, as whole-stage modes price them."""
    if not 0 <= checkpointed <= stage.num_layers:
        raise ValueError(f"checkpointed layers must be within 0..{stage.num_layers}, got {checkpointed}")
    if checkpointed == stage.num_layers:
        return evaluate_stage(t, f, stage, extrapolated)
    rest = evaluate_stage(plain, f, StageSpec(stage.num_layers - checkpointed, first=False, last=False))
    if checkpointed == 0 and not (stage.first or stage.last):
        return replace(rest, extrapolated=extrapolated)
    part = evaluate_stage(t, f, StageSpec(checkpointed, stage.first, stage.last))
    stored = part.stored_bytes + rest.stored_bytes
    transient = max(part.peak_bytes - part.stored_bytes, rest.peak_bytes - rest.stored_bytes)
    return MicroBatchCost(
        part.forward_ms + rest.forward_ms, part.backward_ms + rest.backward_ms, stored, stored + transient, extrapolated
    )
