"""How much compute padding and fixed-length packing waste on a length distribution.

This is the imbalance analysis of Hydraulis (and the DP-imbalance metric of DCP), run on the
real distributions of ``dyn_plugin.lengths.io``. Four ways to batch the same samples:

- ``pad-random``: shuffle (seeded), cut into batches of ``batch_size``, pad each to its longest;
- ``pad-sorted``: the same after sorting by length, the best padding can do (a reference: sorted
  batches hurt convergence, which is why nobody trains that way);
- ``pack-full``: first-fit-decreasing packing into rows of ``max_len`` tokens, with ordinary
  attention over the whole row, so documents attend across each other;
- ``pack-varlen``: the same rows with per-document (varlen) attention.

Cost model. Forward FLOPs of one transformer layer on a sequence of ``s`` tokens with hidden size
``H`` (Megatron-LM, Narayanan et al. 2021)::

    flops(s) = 24 * H**2 * s + 4 * H * s**2

the first term for the QKV/output projections and the MLP (linear in tokens), the second for
the attention scores and their product with V (quadratic). Every metric below is a ratio, so
the number of layers, batch and backward-pass factors cancel. What each layout spends:

- a padded batch of ``b`` samples with longest ``m``: ``b * flops(m)``;
- a packed row with full attention: ``flops(max_len)``; the waste is the padding tail plus the
  cross-document attention ``4H * (max_len**2 - sum(s_i**2))``;
- a packed row with varlen attention: ``24 H**2 * max_len + 4H * sum(s_i**2)``; only the
  padding tail's linear work is waste.

Useful work is ``sum(flops(s_i))`` in every case.

Sequences longer than ``max_len`` are truncated to ``max_len`` for every method (as a trainer with
that context length would) and reported (count and share of tokens dropped), rather than being
an error: real distributions always have a tail past any practical context length.

Data-parallel imbalance: units (padded batches or packed rows), shuffled with the seed, fill
global batches of at most ``token_budget`` real tokens; each global batch is split over ``dp`` ranks with
equal token counts (largest unit first onto the rank with the fewest tokens). Equal tokens are
not equal FLOPs, because of the quadratic term and padding, so with ``t_r`` the FLOPs of rank
``r`` DCP's imbalance is ``sum_r (max(t) - t_r) / R / max(t)``: the share of the step the ranks
spend idle, waiting for the slowest. Reported as the mean over the full global batches.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..atomic import atomic_path
from .io import summarize, validate_lengths
from .packing import pack_rows

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 8
DEFAULT_TOKEN_BUDGET = 2**20  # ~1M tokens per global batch, GPT-3 6.7B trained with 2M
DEFAULT_HIDDEN = 4096  # GPT-3 6.7B / LLaMA-7B
DEFAULT_DP = 8
DEFAULT_SEED = 0


def sequence_flops(lengths, hidden: int = DEFAULT_HIDDEN) -> np.ndarray:
    """Forward FLOPs of one layer per sequence: ``24*H^2*s + 4*H*s^2`` (float64, no overflow)."""
    s = np.asarray(lengths, dtype=np.float64)
    return 24.0 * hidden * hidden * s + 4.0 * hidden * s * s


def next_power_of_two(x: float) -> int:
    return 1 << max(0, int(np.ceil(np.log2(max(x, 1)))))


def default_max_len(lengths: np.ndarray, token_budget: int = DEFAULT_TOKEN_BUDGET, dp: int = DEFAULT_DP) -> int:
    """The power of two at or above p99, capped at one rank's share of the global batch.

    A row longer than ``token_budget / dp`` could not be given to ranks in equal token counts.
    """
    return min(next_power_of_two(float(np.percentile(lengths, 99))), max(1, token_budget // dp))


def truncate(lengths: np.ndarray, max_len: int) -> tuple[np.ndarray, int, int]:
    """Cut sequences to ``max_len``; returns (lengths, how many were cut, tokens dropped)."""
    over = lengths > max_len
    return np.minimum(lengths, max_len), int(over.sum()), int((lengths[over] - max_len).sum())


def pad_batches(
    lengths: np.ndarray, batch_size: int, *, sort: bool = False, seed: int = DEFAULT_SEED
) -> list[np.ndarray]:
    """Batches of ``batch_size`` sample lengths (the last may be smaller): shuffled or sorted."""
    if sort:
        order = np.argsort(-lengths, kind="stable")
    else:
        order = np.random.default_rng(seed).permutation(len(lengths))
    ordered = lengths[order]
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def pack_ffd(lengths: np.ndarray, max_len: int) -> list[np.ndarray]:
    """First-fit-decreasing rows of ``max_len`` tokens (``packing.pack_rows``), as sample lengths."""
    return [lengths[row] for row in pack_rows(lengths, max_len)]


@dataclass(frozen=True)
class Units:
    """What one batching method turns the data into: per unit (padded batch or packed row)."""

    tokens: np.ndarray  # real tokens
    slots: np.ndarray  # token slots the kernels run over, padding included
    flops: np.ndarray  # FLOPs spent
    useful: np.ndarray  # FLOPs of the real tokens alone


def padded_units(batches: Sequence[np.ndarray], hidden: int) -> Units:
    longest = np.array([b.max() for b in batches], dtype=np.int64)
    size = np.array([len(b) for b in batches], dtype=np.int64)
    return Units(
        tokens=np.array([b.sum() for b in batches], dtype=np.int64),
        slots=size * longest,
        flops=size * sequence_flops(longest, hidden),
        useful=np.array([sequence_flops(b, hidden).sum() for b in batches]),
    )


def packed_units(rows: Sequence[np.ndarray], max_len: int, hidden: int, *, varlen: bool) -> Units:
    n = len(rows)
    sum_sq = np.array([np.square(r.astype(np.float64)).sum() for r in rows])
    if varlen:
        flops = 24.0 * hidden * hidden * max_len + 4.0 * hidden * sum_sq
    else:
        flops = np.full(n, sequence_flops(max_len, hidden).item())
    return Units(
        tokens=np.array([r.sum() for r in rows], dtype=np.int64),
        slots=np.full(n, max_len, dtype=np.int64),
        flops=flops,
        useful=np.array([sequence_flops(r, hidden).sum() for r in rows]),
    )


def dcp_imbalance(rank_flops) -> float:
    """DCP's metric: mean idle time of the ranks as a fraction of the slowest rank's time."""
    t = np.asarray(rank_flops, dtype=np.float64)
    return float((t.max() - t).sum() / len(t) / t.max()) if t.max() > 0 else 0.0


def split_equal_tokens(tokens: np.ndarray, dp: int) -> np.ndarray:
    """Rank of each unit, balancing token counts (largest first onto the lightest rank)."""
    heap = [(0, r) for r in range(dp)]
    rank_of = np.empty(len(tokens), dtype=np.int64)
    for i in np.argsort(-tokens, kind="stable"):
        load, r = heapq.heappop(heap)
        rank_of[i] = r
        heapq.heappush(heap, (load + int(tokens[i]), r))
    return rank_of


def dp_imbalance(units: Units, *, token_budget: int, dp: int, seed: int = DEFAULT_SEED) -> float:
    """Mean DCP imbalance over global batches of ``token_budget`` tokens split over ``dp`` ranks.

    Units fill a global batch in shuffled order until the next one would not fit; the trailing
    partial global batch is dropped, as trainers do, unless it is the only one.
    """
    order = np.random.default_rng(seed).permutation(len(units.tokens))
    batches, current, filled = [], [], 0
    for i in order:
        n = int(units.tokens[i])
        # The budget is a cap: overshooting it would hand some ranks an extra unit.
        if current and filled + n > token_budget:
            batches.append(np.array(current))
            current, filled = [], 0
        current.append(i)
        filled += n
    if not batches:
        batches = [np.array(current)]
    values = []
    for idx in batches:
        rank_of = split_equal_tokens(units.tokens[idx], dp)
        values.append(dcp_imbalance(np.bincount(rank_of, weights=units.flops[idx], minlength=dp)))
    return float(np.mean(values))


@dataclass(frozen=True)
class MethodResult:
    name: str
    description: str
    units: int  # padded batches or packed rows
    token_slots: int
    real_tokens: int
    padding_fraction: float  # of token slots
    flops: float  # per layer, forward
    useful_flops: float
    wasted_flop_fraction: float  # of the FLOPs spent
    dp_imbalance: float


def evaluate(name: str, description: str, units: Units, *, token_budget: int, dp: int, seed: int) -> MethodResult:
    slots, tokens = int(units.slots.sum()), int(units.tokens.sum())
    flops, useful = float(units.flops.sum()), float(units.useful.sum())
    return MethodResult(
        name=name,
        description=description,
        units=len(units.tokens),
        token_slots=slots,
        real_tokens=tokens,
        padding_fraction=(slots - tokens) / slots,
        flops=flops,
        useful_flops=useful,
        wasted_flop_fraction=(flops - useful) / flops,
        dp_imbalance=dp_imbalance(units, token_budget=token_budget, dp=dp, seed=seed),
    )


class MethodReport:
    """What an analysis of sequences (``Analysis``) and of pairs (``pair_analysis.PairAnalysis``)
    share: its ``methods``, found by name, and a JSON-ready dict."""

    methods: list

    def method(self, name: str) -> Any:  # MethodResult, or PairMethod
        return next(m for m in self.methods if m.name == name)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Analysis(MethodReport):
    summary: dict
    batch_size: int
    token_budget: int
    dp: int
    hidden: int
    seed: int
    max_len: int
    max_len_is_default: bool
    truncated: int  # samples longer than max_len
    truncated_token_fraction: float
    methods: list[MethodResult] = field(default_factory=list)


def analyze(
    lengths,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    max_len: int | None = None,
    hidden: int = DEFAULT_HIDDEN,
    dp: int = DEFAULT_DP,
    seed: int = DEFAULT_SEED,
) -> Analysis:
    """Padding and packing waste and DP imbalance of a distribution (see the module docstring)."""
    lengths = validate_lengths(lengths)
    for label, value in [
        ("batch_size", batch_size),
        ("token_budget", token_budget),
        ("hidden", hidden),
        ("dp", dp),
    ]:
        if value < 1:
            raise ValueError(f"{label} must be at least 1, got {value}")
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len must be at least 1, got {max_len}")
    is_default = max_len is None
    max_len = default_max_len(lengths, token_budget, dp) if max_len is None else max_len
    cut, n_cut, dropped = truncate(lengths, max_len)
    if n_cut:
        logger.info(
            "truncated %d samples longer than %d tokens (%.2f%% of tokens)",
            n_cut,
            max_len,
            100 * dropped / lengths.sum(),
        )

    rows = pack_ffd(cut, max_len)
    methods = [
        (
            "pad-random",
            f"shuffled batches of {batch_size}, padded to the batch max",
            padded_units(pad_batches(cut, batch_size, seed=seed), hidden),
        ),
        (
            "pad-sorted",
            f"length-sorted batches of {batch_size} (reference)",
            padded_units(pad_batches(cut, batch_size, sort=True), hidden),
        ),
        (
            "pack-full",
            f"FFD rows of {max_len}, attention over the whole row",
            packed_units(rows, max_len, hidden, varlen=False),
        ),
        (
            "pack-varlen",
            f"FFD rows of {max_len}, per-document attention",
            packed_units(rows, max_len, hidden, varlen=True),
        ),
    ]
    return Analysis(
        summary=summarize(lengths),
        batch_size=batch_size,
        token_budget=token_budget,
        dp=dp,
        hidden=hidden,
        seed=seed,
        max_len=max_len,
        max_len_is_default=is_default,
        truncated=n_cut,
        truncated_token_fraction=dropped / int(lengths.sum()),
        methods=[evaluate(n, d, u, token_budget=token_budget, dp=dp, seed=seed) for n, d, u in methods],
    )


def format_analysis(a: Analysis, name: str = "lengths") -> str:
    s = a.summary
    lines = [
        f"{name}: {s['count']:,} samples, {s['total_tokens']:,} tokens; "
        f"mean {s['mean']:,.0f}, p50 {s['p50']:,.0f}, p90 {s['p90']:,.0f}, "
        f"p99 {s['p99']:,.0f}, max {s['max']:,}",
        f"max-len {a.max_len:,}"
        + (" (power of two >= p99)" if a.max_len_is_default else "")
        + f": {a.truncated:,} samples truncated ({100 * a.truncated_token_fraction:.2f}% of tokens dropped)",
        f"FLOPs per layer 24*H^2*s + 4*H*s^2 with H={a.hidden}; DP imbalance over {a.dp} ranks, "
        f"global batches of {a.token_budget:,} tokens",
        "",
        f"{'method':<13}{'units':>8}{'pad slots':>11}{'wasted FLOPs':>14}{'DP imbalance':>14}  description",
    ]
    for m in a.methods:
        lines.append(
            f"{m.name:<13}{m.units:>8,}{100 * m.padding_fraction:>10.1f}%"
            f"{100 * m.wasted_flop_fraction:>13.1f}%{100 * m.dp_imbalance:>13.1f}%  {m.description}"
        )
    return "\n".join(lines)


_TICKS = {
    "pad-random": "shuffled,\nbatches of {a.batch_size}",
    "pad-sorted": "sorted by length\n(reference)",
    "pack-full": "FFD rows,\nfull attention",
    "pack-varlen": "FFD rows,\nvarlen attention",
}


def plot_analysis(lengths, a: Analysis, path: str | Path, name: str = "lengths") -> Path:
    """One figure: the length histogram, where tokens and FLOPs sit, and the waste per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    lengths = validate_lengths(lengths)
    s = a.summary
    tokens_fmt = FuncFormatter(
        lambda x, _: f"{x:,.0f}" if x < 1e4 else f"{x / 1e3:,.0f}K" if x < 1e6 else f"{x / 1e6:,.1f}M"
    )
    fig, (ax_hist, ax_cdf, ax_bar) = plt.subplots(1, 3, figsize=(19, 5.8), gridspec_kw={"width_ratios": [1, 1, 1.25]})
    fig.suptitle(
        f"{name}: {s['count']:,} samples, {s['total_tokens'] / 1e6:,.2f}M tokens "
        f"(FLOPs/layer = 24·H²·s + 4·H·s², H={a.hidden})",
        fontsize=14,
    )

    # Log-spaced bins: the distributions span 1 to 1e6 tokens.
    bins = np.geomspace(lengths.min(), lengths.max() + 1, 60)
    counts, _, _ = ax_hist.hist(lengths, bins=bins, color="#4c72b0", alpha=0.85)
    ax_hist.set_ylim(0, counts.max() * 1.55)  # headroom so the legend never hides bars
    ax_hist.set_xscale("log")
    ax_hist.xaxis.set_major_formatter(tokens_fmt)
    for q, color in [("p50", "#2ca02c"), ("p90", "#ff7f0e"), ("p99", "#d62728")]:
        ax_hist.axvline(s[q], color=color, lw=2, label=f"{q} = {s[q]:,.0f}")
    ax_hist.axvline(
        a.max_len,
        color="black",
        lw=1.5,
        ls="--",
        label=f"max-len = {a.max_len:,} ({a.truncated:,} truncated)",
    )
    ax_hist.set(title="Length distribution", xlabel="sequence length (tokens, log scale)", ylabel="samples")
    ax_hist.legend(loc="upper right", fontsize=9)

    sorted_len = np.sort(lengths)
    x = sorted_len.astype(np.float64)
    flops = sequence_flops(x, a.hidden)
    ax_cdf.plot(x, np.arange(1, len(x) + 1) / len(x), color="gray", lw=2, label="samples")
    ax_cdf.plot(x, np.cumsum(x) / x.sum(), color="#4c72b0", lw=2, label="tokens")
    ax_cdf.plot(x, np.cumsum(flops) / flops.sum(), color="#c44e52", lw=2, label="FLOPs (with attention)")
    ax_cdf.axvline(a.max_len, color="black", lw=1.5, ls="--", label=f"max-len = {a.max_len:,}")
    ax_cdf.set_xscale("log")
    ax_cdf.xaxis.set_major_formatter(tokens_fmt)
    ax_cdf.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax_cdf.set_ylim(0, 1.02)
    long = lengths > s["p90"]
    long_flops = sequence_flops(lengths[long], a.hidden).sum() / sequence_flops(lengths, a.hidden).sum()
    ax_cdf.text(
        0.03,
        0.70,
        f"the longest 10% of samples hold\n{lengths[long].sum() / lengths.sum():.0%} of tokens, "
        f"{long_flops:.0%} of FLOPs",
        transform=ax_cdf.transAxes,
        va="top",
        fontsize=10,
        bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.9, "edgecolor": "0.7"},
    )
    ax_cdf.set(
        title="Share held by sequences up to a length (before truncation)",
        xlabel="sequence length (tokens, log scale)",
        ylabel="cumulative share",
    )
    ax_cdf.legend(loc="upper left", fontsize=9)
    ax_cdf.grid(alpha=0.3)

    names = [m.name for m in a.methods]
    series = [
        ("wasted FLOPs", [m.wasted_flop_fraction for m in a.methods], "#c44e52"),
        ("padded token slots", [m.padding_fraction for m in a.methods], "#4c72b0"),
        (f"DP imbalance, {a.dp} ranks (idle time)", [m.dp_imbalance for m in a.methods], "#8c8c8c"),
    ]
    width = 0.27
    pos = np.arange(len(names))
    for k, (label, values, color) in enumerate(series):
        bars = ax_bar.bar(pos + (k - 1) * width, values, width, label=label, color=color)
        ax_bar.bar_label(
            bars, labels=[f"{v:.0%}" if v >= 0.0995 else f"{v:.1%}" for v in values], fontsize=8.5, padding=2
        )
    ax_bar.set_xticks(pos, [f"{n}\n{_TICKS[n].format(a=a)}" for n in names], fontsize=9)
    ax_bar.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax_bar.set_ylim(0, 1.1)
    ax_bar.set(
        title=f"Waste per batching method (max-len {a.max_len:,}, global batch {a.token_budget:,} tokens)",
        ylabel="wasted share (of FLOPs, slots, rank time)",
    )
    ax_bar.legend(loc="upper right", fontsize=9)
    ax_bar.grid(axis="y", alpha=0.3)

    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return path
