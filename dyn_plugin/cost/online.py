"""Online time calibration: refit the cost model's time terms from the run's own measurements.

The profile is measured once, on one machine in one state. When the run's machine differs
(background load, another clock, a slower node) its predictions go 30-68% wrong, and plans
balanced on them are not. The host measures every micro-batch's forward and backward anyway;
this module turns those measurements into a :class:`Calibration`: four multiplicative factors
that the planner applies to the profiled model (:meth:`Calibration.apply`).

What is fitted. Every time fit is ``max(floor, c0 + c1*slots + c2*attn)`` per component
(cost/table.py). Its terms answer to different hardware: ``c0 + c1*slots`` (the per-micro-batch
constant, the linear layers and element-wise work per token) to matrix throughput and launch
overhead, ``c2*attn`` (attention, per query-key pair) to the attention kernel. So each direction
(forward, backward) gets a *token* factor (scaling c0, c1 and the floor) and a *pair* factor
(scaling c2). For every observed micro-batch the *base* model's prediction on its stage is split
into its token part and its pair part (a binding floor counts as token part), and
``measured ≈ token_factor * token_part + pair_factor * pair_part`` is fitted in relative error
with non-negative factors: 5 ms matter on a 10 ms micro-batch and not on a 2 s one. Factors are
absolute against the base model, never compounded on the last calibration: a fit says what the
machine is now, not how it changed since the last one, so errors do not accumulate. Where the
window cannot tell the two terms apart (the pair part is a small share of every prediction, or
the same share of all of them) one scale is fitted for both, keeping their current ratio.
On a pipeline every observation is priced on its own stage, and a stage that alone runs slower
or faster (by more than ``STAGE_DEVIATION``) gets a factor of its own on its times, fitted from
what the term factors leave on it (:meth:`OnlineCalibrator._stage_factors`).
An encoder-decoder's pair tables (cost/encoder_decoder.py) are not split into terms: their
prediction counts wholly as token part, so each direction gets one scale (its pair factor follows
the token factor, the window never telling them apart) applied to the whole prediction
(``EncoderDecoderCostModel.scale``). Memory: one factor on every activation fit (stored and peak bytes), from the measured peaks
(:meth:`OnlineCalibrator.observe_memory`): the largest measured-over-predicted ratio in its window
with a headroom above it, raised at once (the next plan must not overflow where this one nearly
did) and lowered gradually, so the plans fill what the device really holds.

Why bounded. Plans are compared across steps and published ahead of the steps they price; a
factor that jumps on one bad window (a GC pause, a neighbour's burst) would swing every plan
after it. So one update moves a factor by at most ``max_change`` (a ratio), measurements beyond
``outlier`` robust deviations of a first fit are dropped before the final one, the first steps
(compilation, allocator warm-up) are ignored, and a new version is published only when some
factor moved by more than ``tolerance``. The price of robustness is lag: a lasting change
(the machine really did slow down) looks like outliers until it holds most of the window, and is
then adopted in steps of ``max_change``; size ``window`` to the observations of a few steps.

Why deterministic. Every rank runs its own calibrator on the same all-gathered measurements and
must reach the same plan without talking again, so a calibrator is a pure state machine: no
clock, no randomness, no dict-order dependence, and its arithmetic is plain Python floats with
correctly rounded sums (``math.fsum``) and a closed-form two-unknown solve rather than LAPACK,
whose results may depend on the CPU a rank landed on. The same observations in the same order
give bit-identical calibrations; observations within one :meth:`OnlineCalibrator.observe` call
are put in a canonical order first, so the order a gather returns them in does not matter.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections import deque
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Callable, Iterable, Literal, Sequence, TypeVar

from .encoder_decoder import EncoderDecoderCostModel, PairStage
from .model import LAYOUTS, RECOMPUTES, Features, Layout, Recompute, StageSpec, features
from .table import CostTable, LinearFit, TableCostModel, evaluate_stage

logger = logging.getLogger(__name__)

Direction = Literal["forward", "backward"]
Term = Literal["token", "pair"]
CalibratedModel = TypeVar("CalibratedModel", TableCostModel, EncoderDecoderCostModel)  # what a calibration scales
DIRECTIONS: tuple[Direction, ...] = ("forward", "backward")
TERMS: tuple[Term, ...] = ("token", "pair")
# the time metrics a direction's factors scale: a measured weight-gradient time is part of the backward
METRICS_OF: dict[Direction, tuple[str, ...]] = {"forward": ("forward_ms",), "backward": ("backward_ms", "weight_ms")}
MEMORY_METRICS = ("stored_bytes", "peak_bytes")  # a micro-batch's activations, scaled by the memory factor
STATE_FORMAT = 1
# one robust deviation (the median absolute deviation of the log ratio, times 1.4826: a normal's
# sigma) is never taken below 1%: timings jitter that much on any machine, and a window fitted
# exactly (synthetic, or a quiet machine) would otherwise call every last-digit difference an outlier
MIN_DEVIATION = 0.01
MAD_TO_SIGMA = 1.4826
# the activation memory factor sits this far above the largest measured/predicted peak seen: the
# next micro-batches are others, and an overflow on one rank stops every rank
MEMORY_HEADROOM = 1.03
# a pipeline stage gets a factor of its own only where its times differ from the others' by more than this
STAGE_DEVIATION = 0.05


@dataclass(frozen=True)
class Calibration:
    """Multiplicative factors on the profiled model's time terms, numbered and dated.

    ``version`` 0 is the profile as measured; ``from_step`` is the first global step plans priced
    with it may run in (later versions are published ahead of the steps they price). Token factors
    scale each time fit's c0, c1 and floor; pair factors its c2 (see the module docstring).
    """

    version: int = 0
    from_step: int = 0
    forward_token: float = 1.0
    forward_pair: float = 1.0
    backward_token: float = 1.0
    backward_pair: float = 1.0
    # activation memory (every stored_bytes and peak_bytes fit), measured peak over predicted
    memory: float = 1.0
    # per pipeline stage, a factor on its time beside the term factors: a stage that alone runs
    # slower (another GPU, a node's clock); () is 1 on every stage. The planner applies it
    # (PlanningContext: the spec's stage_time), not ``apply``: a table is shared by every stage
    stages: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"calibration version = {self.version!r}: must be an integer >= 0 (0: the profile)")
        if not isinstance(self.from_step, int) or self.from_step < 0:
            raise ValueError(f"calibration from_step = {self.from_step!r}: must be a global step, an integer >= 0")
        for d in DIRECTIONS:
            for t in TERMS:
                v = self.factor(d, t)
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                    raise ValueError(
                        f"calibration {d}_{t} = {v!r}: a factor must be a finite number > 0 (1.0: as profiled)"
                    )
        if not (isinstance(self.memory, (int, float)) and math.isfinite(self.memory) and self.memory > 0):
            raise ValueError(f"calibration memory = {self.memory!r}: must be a finite number > 0 (1.0: as profiled)")
        object.__setattr__(self, "stages", tuple(float(x) for x in self.stages))
        if not all(math.isfinite(x) and x > 0 for x in self.stages):
            raise ValueError(
                f"calibration stages = {self.stages!r}: a factor per pipeline stage, each finite and > 0 (() for none)"
            )

    def stage_factor(self, stage: int) -> float:
        """The factor on ``stage``'s time beside the term factors (1 where none was fitted)."""
        return self.stages[stage] if stage < len(self.stages) else 1.0

    def factor(self, direction: Direction, term: Term) -> float:
        return getattr(self, f"{direction}_{term}")

    @property
    def factors(self) -> dict[str, dict[str, float]]:
        """{direction: {term: factor}}."""
        return {d: {t: self.factor(d, t) for t in TERMS} for d in DIRECTIONS}

    @property
    def is_identity(self) -> bool:
        return (
            self.memory == 1.0
            and all(self.factor(d, t) == 1.0 for d in DIRECTIONS for t in TERMS)
            and all(x == 1.0 for x in self.stages)
        )

    def describe(self) -> str:
        """One line for logs: ``v3 from step 40: forward token x1.250 pair x1.000, backward ...``."""
        parts = ", ".join(
            f"{d} token x{self.factor(d, 'token'):.3f} pair x{self.factor(d, 'pair'):.3f}" for d in DIRECTIONS
        )
        stages = f", stages {' '.join(f'x{x:.3f}' for x in self.stages)}" if self.stages else ""
        return f"v{self.version} from step {self.from_step}: {parts}, activation memory x{self.memory:.3f}{stages}"

    def apply(self, cost: CalibratedModel) -> CalibratedModel:
        """A new model whose time fits are scaled by these factors; ``cost`` is not changed.

        Memory fits (a micro-batch's activations: stored and peak bytes) are scaled by ``memory``;
        model states are priced apart and kept. The identity calibration gives a model whose
        predictions equal ``cost``'s exactly (every coefficient is multiplied by 1.0, which is exact).
        An encoder-decoder's model takes the token factors on its whole forward and backward.
        """
        if isinstance(cost, EncoderDecoderCostModel):
            f, b, m = cost.scale
            return replace(cost, scale=(f * self.forward_token, b * self.backward_token, m * self.memory))
        if not isinstance(cost, TableCostModel):
            raise TypeError(f"online calibration applies to a TableCostModel; got {type(cost).__name__}")
        tables = {key: self._scaled_table(t) for key, t in cost.tables.items()}
        # replace() builds a fresh C++ table cache (_native is not an init field): the scaled
        # coefficients are never served from the profile's cache
        return replace(cost, tables=tables)

    def _scaled_table(self, t: CostTable) -> CostTable:
        fits = {}
        for comp, metrics in t.fits.items():
            out = dict(metrics)
            for d in DIRECTIONS:
                tok, pair = self.factor(d, "token"), self.factor(d, "pair")
                for m in METRICS_OF[d]:
                    if m in out:
                        out[m] = _scale_fit(out[m], tok, pair)
            for m in MEMORY_METRICS:
                if m in out:
                    out[m] = _scale_fit(out[m], self.memory, self.memory)
            fits[comp] = out
        return replace(t, fits=fits)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (as published through the plan store); :meth:`from_dict` inverts it exactly."""
        d = {"version": self.version, "from_step": self.from_step, "factors": self.factors, "memory": self.memory}
        return {**d, "stages": list(self.stages)} if self.stages else d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Calibration":
        if not isinstance(d, dict) or not {"version", "from_step", "factors"} <= d.keys():
            raise ValueError(
                f"a calibration is a dict with 'version', 'from_step' and 'factors' (Calibration.to_dict()); got {d!r}"
            )
        factors = d["factors"]
        kw: dict[str, float] = {}
        for direction in DIRECTIONS:
            for term in TERMS:
                try:
                    kw[f"{direction}_{term}"] = float(factors[direction][term])
                except (KeyError, TypeError, ValueError):
                    raise ValueError(
                        f"calibration factors[{direction!r}][{term!r}] is missing or not a number; "
                        "expected {'forward': {'token': x, 'pair': y}, 'backward': {...}}"
                    ) from None
        return cls(
            version=d["version"],
            from_step=d["from_step"],
            memory=float(d.get("memory", 1.0)),
            stages=tuple(d.get("stages", ())),
            **kw,
        )


def _scale_fit(fit: LinearFit, token: float, pair: float) -> LinearFit:
    scaled = fit.map_terms(lambda c: (c[0] * token, c[1] * token, c[2] * pair))
    # the floor is the smallest time any kernel takes: per-kernel overhead, as the constant is
    return replace(scaled, floor=fit.floor * token)


@dataclass(frozen=True)
class Observation:
    """One measured micro-batch: what ran, where, when, and how long each direction took.

    ``backward_ms`` is None for a forward-only micro-batch (evaluation). ``stage`` is the pipeline
    stage index (0 without a pipeline); ``step`` the global step it ran in. ``shape``: an
    encoder-decoder micro-batch's (rows, input width, target width), which price it (``seq_lens``
    are then its inputs' lengths); () for a decoder-only one.
    """

    seq_lens: tuple[int, ...]
    layout: Layout
    recompute: Recompute
    tp: int
    stage: int
    forward_ms: float
    backward_ms: float | None
    step: int
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        shape = tuple(int(x) for x in self.shape)
        if shape and (len(shape) != 3 or min(shape) <= 0):
            raise ValueError(
                f"observation shape = {self.shape!r}: an encoder-decoder micro-batch's (rows, input width, "
                "target width), all positive, or () for a decoder-only one"
            )
        object.__setattr__(self, "shape", shape)
        lens = tuple(int(s) for s in self.seq_lens)
        if not lens or min(lens) <= 0:
            raise ValueError(f"observation seq_lens = {self.seq_lens!r}: needs at least one positive length")
        object.__setattr__(self, "seq_lens", lens)
        if self.layout not in LAYOUTS:
            raise ValueError(f"observation layout = {self.layout!r}: expected one of {', '.join(LAYOUTS)}")
        if self.recompute not in RECOMPUTES:
            raise ValueError(f"observation recompute = {self.recompute!r}: expected one of {', '.join(RECOMPUTES)}")
        if int(self.tp) < 1 or int(self.stage) < 0 or int(self.step) < 0:
            raise ValueError(
                f"observation tp = {self.tp}, stage = {self.stage}, step = {self.step}: need tp >= 1, stage >= 0, step >= 0"
            )
        object.__setattr__(self, "tp", int(self.tp))
        object.__setattr__(self, "stage", int(self.stage))
        object.__setattr__(self, "step", int(self.step))

    def measured(self, direction: Direction) -> float | None:
        return self.forward_ms if direction == "forward" else self.backward_ms

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["seq_lens"] = list(self.seq_lens)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Observation":
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d or f.name != "shape"})

    def _key(self) -> tuple:
        # a total order over everything an observation holds: the canonical order within one step
        bwd = -1.0 if self.backward_ms is None else float(self.backward_ms)
        return (
            self.step,
            self.stage,
            self.layout,
            self.recompute,
            self.tp,
            self.seq_lens,
            self.shape,
            float(self.forward_ms),
            bwd,
        )


@dataclass(frozen=True)
class CalibrationSettings:
    """How an :class:`OnlineCalibrator` fits; see the module docstring for why each exists.

    - ``warmup_steps``: observations from steps below it are ignored (compilation, allocation);
    - ``window``: the most recent observations per direction that are fitted;
    - ``every``: refit every this many steps;
    - ``max_change``: one update moves a factor by at most this ratio (1.25: within x0.8..x1.25);
    - ``outlier``: measurements beyond this many robust deviations of a first fit are dropped;
    - ``min_observations``: a direction is fitted only with at least this many in its window;
    - ``tolerance``: a new version only when some factor moved by more than this share;
    - ``min_pair_share``: below this share of the window's predicted time, attention is not
      fitted apart (nor when its share hardly varies, ``min_pair_spread``): one scale for both terms;
    - ``min_factor``, ``max_factor``: the absolute range of every factor.
    """

    warmup_steps: int = 3
    window: int = 256
    every: int = 10
    max_change: float = 1.25
    outlier: float = 4.0
    min_observations: int = 16
    tolerance: float = 0.02
    min_pair_share: float = 0.05
    min_pair_spread: float = 0.02
    min_factor: float = 0.1
    max_factor: float = 10.0

    def __post_init__(self) -> None:
        where = "online calibration"
        for name in ("warmup_steps", "window", "every", "min_observations"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{where}: {name} = {v!r} must be an integer")
        if self.warmup_steps < 0:
            raise ValueError(f"{where}: warmup_steps = {self.warmup_steps} must be >= 0 (0: fit from the first step)")
        if self.every < 1:
            raise ValueError(f"{where}: every = {self.every} must be >= 1 (refit every this many steps)")
        if self.min_observations < 2:
            raise ValueError(
                f"{where}: min_observations = {self.min_observations} must be >= 2 (two factors per direction); e.g. 16"
            )
        if self.window < self.min_observations:
            raise ValueError(
                f"{where}: window = {self.window} is below min_observations = {self.min_observations}: no fit "
                "could ever run; raise window or lower min_observations"
            )
        if not self.max_change > 1.0 or not math.isfinite(self.max_change):
            raise ValueError(
                f"{where}: max_change = {self.max_change} must be a finite ratio > 1 (how far one update may move "
                "a factor), e.g. 1.25"
            )
        if not self.outlier > 0 or not math.isfinite(self.outlier):
            raise ValueError(f"{where}: outlier = {self.outlier} must be > 0 robust deviations, e.g. 4")
        if not 0 <= self.tolerance < self.max_change - 1:
            raise ValueError(
                f"{where}: tolerance = {self.tolerance} must be >= 0 and below max_change - 1 = "
                f"{self.max_change - 1:g}, or no update could ever pass it; e.g. 0.02"
            )
        for name in ("min_pair_share", "min_pair_spread"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{where}: {name} = {getattr(self, name)} must be within [0, 1), e.g. 0.05")
        if not 0 < self.min_factor <= 1 <= self.max_factor < math.inf:
            raise ValueError(
                f"{where}: min_factor = {self.min_factor}, max_factor = {self.max_factor}: need "
                "0 < min_factor <= 1 <= max_factor (finite), e.g. 0.1 and 10"
            )


def split_terms(t: CostTable, f: Features, stage: StageSpec, metric: str) -> tuple[float, float]:
    """(token part, pair part) of a stage's ``metric`` time for features ``f``; they sum to what
    :func:`~dyn_plugin.cost.table.evaluate_stage` prices. A component whose floor binds counts it
    as token part (the floor is per-kernel overhead, not attention)."""
    counts = (("embedding", int(stage.first)), ("layer", stage.num_layers), ("head", int(stage.last)))
    token = pair = 0.0
    for comp, k in counts:
        if k == 0 or metric not in t.fits.get(comp, {}):
            continue
        fit = t.fits[comp][metric]
        c0, c1, c2 = fit.coef_at(f.attn / f.slots) if fit.bands else fit.coef
        tok, pr = c0 + c1 * f.slots, c2 * f.attn
        if fit.floor >= tok + pr:
            token += k * fit.floor
        else:
            token += k * tok
            pair += k * pr
    return token, pair


@dataclass(frozen=True)
class _Sample:
    """One direction of one observation, split against the base model."""

    obs: Observation
    measured: float
    token: float
    pair: float


@dataclass(frozen=True)
class _Fit:
    token: float
    pair: float
    kept: int
    dropped: int
    joint: bool  # one scale for both terms (attention not identifiable in the window)
    error_before: float  # mean absolute percentage error of the window under the current factors
    error_after: float  # ... under the fitted ones (before bounding)


def _relative_lsq(samples: Sequence[_Sample], ratio: tuple[float, float] | None) -> tuple[float, float]:
    """Non-negative (token, pair) factors minimising sum(((a*T + b*P) - y) / y)^2.

    With ``ratio`` = (a0, b0) only one scale s is fitted and (s*a0, s*b0) returned. Closed form
    with correctly rounded sums (the same as ``table.nnls_relative`` over two columns, without
    LAPACK): deterministic to the bit on every CPU.
    """
    if ratio is not None:
        r = [(ratio[0] * s.token + ratio[1] * s.pair) / s.measured for s in samples]
        scale = math.fsum(r) / math.fsum(x * x for x in r)
        return scale * ratio[0], scale * ratio[1]
    u = [s.token / s.measured for s in samples]
    v = [s.pair / s.measured for s in samples]
    suu, svv, suv = math.fsum(x * x for x in u), math.fsum(x * x for x in v), math.fsum(x * y for x, y in zip(u, v))
    su, sv = math.fsum(u), math.fsum(v)

    def err(a: float, b: float) -> float:
        return math.fsum((a * x + b * y - 1.0) ** 2 for x, y in zip(u, v))

    candidates = []
    det = suu * svv - suv * suv
    if det > 1e-12 * suu * svv:
        a, b = (su * svv - sv * suv) / det, (sv * suu - su * suv) / det
        if a >= 0 and b >= 0:
            candidates.append((a, b))
    if suu > 0:
        candidates.append((su / suu, 0.0))
    if svv > 0:
        candidates.append((0.0, sv / svv))
    # the first of equal errors wins: candidates are in a fixed order
    return min(candidates, key=lambda c: err(*c))


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _mape(samples: Iterable[_Sample], token: float, pair: float) -> float:
    ape = [abs(token * s.token + pair * s.pair - s.measured) / s.measured for s in samples]
    return math.fsum(ape) / len(ape) if ape else 0.0


class OnlineCalibrator:
    """Turns the run's measured micro-batches into :class:`Calibration` versions.

    ``base``: the profiled model (the factors are against it, never against an earlier
    calibration); ``stages``: a :class:`StageSpec` per pipeline stage index, or a function from
    the index to it (observations are priced on their own stage: the first holds the embedding,
    the last the head). Feed each step's observations to :meth:`observe` (all ranks', in the
    same order everywhere) and call :meth:`maybe_update` once per step.
    """

    def __init__(
        self,
        base: CalibratedModel,
        stages: Sequence[StageSpec] | Sequence[PairStage] | Callable[[int], Any],
        settings: CalibrationSettings | None = None,
        *,
        calibration: Calibration | None = None,
    ) -> None:
        if not isinstance(base, (TableCostModel, EncoderDecoderCostModel)):
            raise TypeError(
                f"online calibration needs a TableCostModel or an EncoderDecoderCostModel as its base; got "
                f"{type(base).__name__}"
            )
        self.base = base
        self.settings = settings if settings is not None else CalibrationSettings()
        if callable(stages):
            self._stage_of: Callable[[int], StageSpec] = stages
        else:
            specs = tuple(stages)
            if not specs:
                raise ValueError("online calibration: stages is empty; give one StageSpec per pipeline stage")

            def stage_of(i: int) -> StageSpec:
                if not 0 <= i < len(specs):
                    raise ValueError(
                        f"observation on stage {i}, but the calibrator knows {len(specs)} stages (0..{len(specs) - 1})"
                    )
                return specs[i]

            self._stage_of = stage_of
        self.calibration = calibration if calibration is not None else Calibration()
        self._samples: dict[Direction, deque[_Sample]] = {d: deque(maxlen=self.settings.window) for d in DIRECTIONS}
        self._memory: deque[float] = deque(maxlen=self.settings.window)  # measured / base-predicted activation peaks
        self._last_fit_step: int | None = None
        self._applied: tuple[Calibration, TableCostModel] | None = None
        self.last_fits: dict[Direction, _Fit] = {}  # the latest fit per direction, for logs and tests

    # -- feeding -------------------------------------------------------------------------------

    def observe(self, observations: Sequence[Observation]) -> None:
        """Add one step's observations (any order: they are sorted canonically first).

        Observations from warm-up steps are ignored, and so is a direction whose measurement is
        missing (forward-only), not finite or not positive (relative error needs a positive time).
        """
        for obs in sorted(observations, key=Observation._key):
            if obs.step < self.settings.warmup_steps:
                continue
            for d in DIRECTIONS:
                y = obs.measured(d)
                if y is None or not math.isfinite(y) or y <= 0:
                    continue
                token, pair = self._split(obs, d)
                if token + pair <= 0:
                    continue  # the profile prices it at nothing: no factor can say anything
                self._samples[d].append(_Sample(obs, float(y), token, pair))

    def _split(self, obs: Observation, direction: Direction) -> tuple[float, float]:
        if isinstance(self.base, EncoderDecoderCostModel):  # not split into terms: all of it is token part
            return _pair_times(self.base, obs, self._stage_of(obs.stage))[DIRECTIONS.index(direction)], 0.0
        t = self.base.table(obs.layout, obs.recompute, obs.tp)
        f = features(obs.seq_lens, obs.layout, self.base.pad_multiple)
        return split_terms(t, f, self._stage_of(obs.stage), METRICS_OF[direction][0])

    def observations(self, direction: Direction) -> int:
        """How many observations the window of ``direction`` holds."""
        return len(self._samples[direction])

    # -- fitting -------------------------------------------------------------------------------

    def maybe_update(
        self, step: int, *, from_step: int | None = None, memory_from_step: int | None = None
    ) -> Calibration | None:
        """Refit when due (every ``every`` steps past warm-up, with ``min_observations`` in a
        window); return the next version, pricing steps from ``from_step`` (default ``step + 1``),
        when some factor moved by more than ``tolerance``, else None.

        The memory factor is the largest measured-over-predicted activation peak in its window
        (``observe_memory``) with ``MEMORY_HEADROOM`` above it. It rises at once, at any step, and
        the version then prices from ``memory_from_step`` (default ``step + 1``: the next plan must
        not overflow where this one nearly did); it falls by at most ``max_change`` per refit."""
        s = self.settings
        cur = self.calibration
        start = step + 1 if from_step is None else from_step
        urgent = step + 1 if memory_from_step is None else memory_from_step
        if min(start, urgent) <= step:
            raise ValueError(
                f"from_step = {min(start, urgent)} at step {step}: a version prices steps still to be planned, "
                "after the one it was fitted at"
            )
        memory = cur.memory
        if self._memory:
            target = max(self._memory) * MEMORY_HEADROOM
            memory = target if target > cur.memory else max(target, cur.memory / s.max_change, s.min_factor)
        rises = memory > cur.memory * (1 + s.tolerance)
        due = step >= s.warmup_steps and (self._last_fit_step is None or step >= self._last_fit_step + s.every)
        if not (due or rises):
            return None
        new = dict(cur.factors)
        ready = [d for d in DIRECTIONS if due and len(self._samples[d]) >= s.min_observations]
        if ready:
            self._last_fit_step = step
        for d in ready:
            fit = self._fit(d, (cur.factor(d, "token"), cur.factor(d, "pair")), cur)
            self.last_fits[d] = fit
            new[d] = {t: self._bounded(cur.factor(d, t), getattr(fit, t)) for t in TERMS}
        stages = self._stage_factors(new, cur) if ready else cur.stages
        moved = max(
            [abs(new[d][t] / cur.factor(d, t) - 1.0) for d in DIRECTIONS for t in TERMS]
            + [abs(x / cur.stage_factor(i) - 1.0) for i, x in enumerate(stages)]
        )
        if not due:
            memory_moved = rises
        else:
            memory_moved = abs(memory / cur.memory - 1.0) > s.tolerance
        if moved <= s.tolerance and not memory_moved:
            return None
        self.calibration = Calibration(
            version=cur.version + 1,
            from_step=urgent if rises else start,
            memory=memory if memory_moved else cur.memory,
            **{f"{d}_{t}": new[d][t] for d in DIRECTIONS for t in TERMS},
            stages=stages,
        )
        logger.info(
            "online calibration %s (fitted at step %d; %s)",
            self.calibration.describe(),
            step,
            "; ".join(
                [
                    f"{d}: {f.kept} kept, {f.dropped} outliers, {'one scale' if f.joint else 'two terms'}, "
                    f"window error {100 * f.error_before:.1f}% -> {100 * f.error_after:.1f}%"
                    for d, f in sorted(self.last_fits.items())
                    if d in ready
                ]
                + ([f"memory: largest measured/predicted {max(self._memory):.3f}"] if self._memory else [])
            ),
        )
        return self.calibration

    def observe_memory(self, step: int, ratios: Sequence[float]) -> None:
        """One step's measured activation peaks over what the *base* model predicted for them (one
        per rank; its order does not matter: the window's largest is what is used). Warm-up steps,
        and ratios that are not finite and positive, are ignored."""
        if step < self.settings.warmup_steps:
            return
        self._memory.extend(sorted(float(r) for r in ratios if math.isfinite(r) and r > 0))

    def _stage_factors(self, terms: dict[str, dict[str, float]], cur: Calibration) -> tuple[float, ...]:
        """Per pipeline stage, the median of measured over predicted under the new term factors,
        over both directions' windows, over the median of all of them: what one stage runs slower
        or faster than the others (a slowdown of every stage stays the terms' to fit). The terms
        are fitted on times divided by the current stage factors, so the two parts settle (two
        stages, one 2x slower: x0.67 and x1.33 on terms of x1.5). Fitted once the windows hold two
        stages with two observations each; bounded per refit as every factor."""
        ratios: dict[int, list[float]] = {}
        for d in DIRECTIONS:
            a, b = terms[d]["token"], terms[d]["pair"]
            for x in self._samples[d]:
                ratios.setdefault(x.obs.stage, []).append(x.measured / (a * x.token + b * x.pair))
        if sum(len(r) >= 2 for r in ratios.values()) < 2:
            return cur.stages
        overall = _median([r for stage in sorted(ratios) for r in ratios[stage]])
        count = max(max(ratios) + 1, len(cur.stages))
        out = []
        for i in range(count):
            if len(ratios.get(i, ())) < 2:
                out.append(cur.stage_factor(i))
                continue
            target = _median(ratios[i]) / overall
            # within STAGE_DEVIATION of the others: the terms' own misfit while they settle (stages
            # hold different shares of embedding, head and attention), not a slower stage
            out.append(self._bounded(cur.stage_factor(i), 1.0 if abs(target - 1.0) <= STAGE_DEVIATION else target))
        return tuple(out) if any(x != 1.0 for x in out) else ()

    def _fit(self, direction: Direction, current: tuple[float, float], cur: Calibration) -> _Fit:
        # each time as if its stage ran at the others' pace: the stage factors take the difference
        window = [replace(x, measured=x.measured / cur.stage_factor(x.obs.stage)) for x in self._samples[direction]]
        s = self.settings
        ratio = current if self._joint(window) else None
        first = _relative_lsq(window, ratio)
        # robust deviations of the log ratio measured/predicted around their median
        logs = [math.log(x.measured / max(first[0] * x.token + first[1] * x.pair, 1e-300)) for x in window]
        mid = _median(logs)
        dev = max(MAD_TO_SIGMA * _median([abs(r - mid) for r in logs]), MIN_DEVIATION)
        kept = [x for x, r in zip(window, logs) if abs(r - mid) <= s.outlier * dev]
        joint = self._joint(kept)
        token, pair = _relative_lsq(kept, current if joint else None)
        return _Fit(
            token=token,
            pair=pair,
            kept=len(kept),
            dropped=len(window) - len(kept),
            joint=joint,
            error_before=_mape(window, *current),
            error_after=_mape(kept, token, pair),
        )

    def _joint(self, samples: Sequence[_Sample]) -> bool:
        """Whether attention cannot be told apart in ``samples``: its part is a small share of the
        predicted time, or (nearly) the same share of every micro-batch, so that any split of the
        time between the terms fits as well as any other."""
        total = math.fsum(x.token + x.pair for x in samples)
        share = math.fsum(x.pair for x in samples) / total
        if share < self.settings.min_pair_share:
            return True
        shares = [x.pair / (x.token + x.pair) for x in samples]
        mean = math.fsum(shares) / len(shares)
        spread = math.sqrt(math.fsum((x - mean) ** 2 for x in shares) / len(shares))
        return spread < self.settings.min_pair_spread

    def _bounded(self, current: float, fitted: float) -> float:
        s = self.settings
        lo, hi = current / s.max_change, current * s.max_change
        return min(max(fitted, lo, s.min_factor), hi, s.max_factor)

    # -- reporting -----------------------------------------------------------------------------

    def prediction_error(
        self,
        observations: Sequence[Observation],
        calibration: Calibration | None = None,
        *,
        direction: Direction | None = None,
    ) -> float:
        """Mean absolute percentage error of ``observations`` (both directions, or ``direction``)
        under ``calibration`` (default: the current one), priced by the calibrated model exactly as
        the planner prices them; the measured range is not enforced (these micro-batches ran)."""
        cal = calibration if calibration is not None else self.calibration
        if self._applied is None or self._applied[0] != cal:
            self._applied = (cal, cal.apply(self.base))
        model = self._applied[1]
        ape: list[float] = []
        for obs in observations:
            stage = self._stage_of(obs.stage)
            if isinstance(model, EncoderDecoderCostModel):
                times = _pair_times(model, obs, stage)
            else:
                t = model.table(obs.layout, obs.recompute, obs.tp)
                cost = evaluate_stage(t, features(obs.seq_lens, obs.layout, model.pad_multiple), stage)
                times = (cost.forward_ms, cost.backward_ms)
            for d in DIRECTIONS if direction is None else (direction,):
                y = obs.measured(d)
                if y is not None and math.isfinite(y) and y > 0:
                    ape.append(abs(times[DIRECTIONS.index(d)] * cal.stage_factor(obs.stage) - y) / y)
        return math.fsum(ape) / len(ape) if ape else 0.0

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state for a checkpoint: the current calibration, the windows, when it last fitted."""
        return {
            "format": STATE_FORMAT,
            "base": _fingerprint(self.base),
            "settings": asdict(self.settings),
            "calibration": self.calibration.to_dict(),
            "last_fit": self._last_fit_step,
            "windows": {
                d: [{**x.obs.to_dict(), "direction_ms": x.measured} for x in self._samples[d]] for d in DIRECTIONS
            },
            "memory": list(self._memory),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output. Settings stay this calibrator's own (a window
        changed on restart keeps the most recent observations); the base model must be the one the
        state was fitted against, or its factors would mean something else."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"online calibration state format {state.get('format')!r}: this version reads {STATE_FORMAT}; "
                "start the calibration afresh (drop its state from the checkpoint)"
            )
        if state["base"] != _fingerprint(self.base):
            raise ValueError(
                f"online calibration state was fitted against another cost model than {self.base.name!r} (its "
                "time fits differ): load the profile it was fitted against, or start the calibration afresh"
            )
        if state["settings"] != asdict(self.settings):
            logger.info("online calibration resumes with changed settings: %s", self.settings)
        self.calibration = Calibration.from_dict(state["calibration"])
        self._last_fit_step = state["last_fit"]
        self._applied = None
        self.last_fits = {}
        for d in DIRECTIONS:
            window: deque[_Sample] = deque(maxlen=self.settings.window)
            for rec in state["windows"][d]:
                obs = Observation.from_dict(rec)
                token, pair = self._split(obs, d)
                window.append(_Sample(obs, float(rec["direction_ms"]), token, pair))
            self._samples[d] = window
        self._memory = deque(state.get("memory", []), maxlen=self.settings.window)


def _pair_times(model: EncoderDecoderCostModel, obs: Observation, stage: PairStage) -> tuple[float, float]:
    """(forward ms, backward ms) of an encoder-decoder micro-batch on its stage, as the pair planner prices it."""
    if not obs.shape:
        raise ValueError(
            "observation of an encoder-decoder micro-batch without its shape: give (rows, input width, target width)"
        )
    n, se, sd = obs.shape
    fwd, bwd, _, _ = model.stage_costs(stage, n, se, sd, recompute=obs.recompute, tp=obs.tp)
    return float(fwd), float(bwd)


def _fingerprint(cost: CalibratedModel) -> str:
    """A digest of the model's time fits (what the factors are against), stable across processes."""
    if isinstance(cost, EncoderDecoderCostModel):
        text = json.dumps(cost.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]
    times = {
        f"{l}/{r}/{tp}": {
            c: {m: [*f.coef, f.floor, *(x for b in f.bands for x in b)] for m, f in ms.items() if m.endswith("_ms")}
            for c, ms in sorted(t.fits.items())
        }
        for (l, r, tp), t in sorted(cost.tables.items())
    }
    text = json.dumps({"pad_multiple": cost.pad_multiple, "tables": times}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


__all__ = [
    "Calibration",
    "CalibrationSettings",
    "Observation",
    "OnlineCalibrator",
    "split_terms",
]
