"""How many token slots padding and packing waste on each side of (input, target) pairs (T5).

The analysis of ``lengths.analysis``, for encoder-decoder samples: the encoder runs over the
inputs and the decoder over the targets, so each side has its own token slots and its own
padding. Two ways to batch the same pairs:

- ``pad-random``: shuffled (seeded) micro-batches of ``batch_size`` pairs, each padded to its
  longest input on the encoder side and to its longest target on the decoder side;
- ``pack``: T5 packing per side, pairs kept whole: first-fit-decreasing rows
  (``packing.pack_pair_rows``) whose inputs fill an encoder row of ``max_input`` tokens and whose
  targets fill a decoder row of ``max_target`` tokens.

Reported per side: token slots, real tokens, and the fraction of slots that are padding; and over
both sides together. Slots only, no FLOPs: an encoder-decoder layer's cost (cross-attention over
input x target) is the cost model's to price, not a ratio of tokens.

As in ``analysis``, each side is truncated to its maximum (default: the power of two at or
above that side's p99) for every method, and what was cut is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike

from .analysis import DEFAULT_BATCH_SIZE, DEFAULT_SEED, MethodReport, default_max_len, pad_batches, truncate
from .packing import pack_pair_rows
from .pairs import SIDES, format_pair_summary, summarize_pairs, validate_pairs


@dataclass(frozen=True)
class SideLimit:
    """One side's row length and what truncating to it cut."""

    max_len: int
    max_len_is_default: bool
    truncated: int  # pairs whose side was longer than max_len
    truncated_token_fraction: float  # of that side's tokens


@dataclass(frozen=True)
class SideWaste:
    token_slots: int  # padding included
    real_tokens: int
    padding_fraction: float  # of token_slots


@dataclass(frozen=True)
class PairMethod:
    name: str
    description: str
    units: int  # padded micro-batches or packed rows
    input: SideWaste
    target: SideWaste
    padding_fraction: float  # of both sides' token slots together


@dataclass(frozen=True)
class PairAnalysis(MethodReport):
    summary: dict  # pairs.summarize_pairs, before truncation
    batch_size: int
    seed: int
    input: SideLimit
    target: SideLimit
    methods: list[PairMethod] = field(default_factory=list)


def _side(slots: int, tokens: int) -> SideWaste:
    return SideWaste(token_slots=slots, real_tokens=tokens, padding_fraction=(slots - tokens) / slots)


def _method(name: str, description: str, units: int, slots: tuple[int, int], tokens: tuple[int, int]) -> PairMethod:
    return PairMethod(
        name=name,
        description=description,
        units=units,
        input=_side(slots[0], tokens[0]),
        target=_side(slots[1], tokens[1]),
        padding_fraction=(sum(slots) - sum(tokens)) / sum(slots),
    )


def analyze_pairs(
    pairs: ArrayLike,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_input: int | None = None,
    max_target: int | None = None,
    seed: int = DEFAULT_SEED,
) -> PairAnalysis:
    """Padding of padded micro-batches and of per-side packing, per side (see the module docstring)."""
    pairs = validate_pairs(pairs)
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    limits, cut = [], []
    for c, (side, given) in enumerate(zip(SIDES, (max_input, max_target))):
        if given is not None and given < 1:
            raise ValueError(f"max_{side} must be at least 1, got {given}")
        max_len = default_max_len(pairs[:, c]) if given is None else given
        lengths, n_cut, dropped = truncate(pairs[:, c], max_len)
        cut.append(lengths)
        limits.append(SideLimit(max_len, given is None, n_cut, dropped / int(pairs[:, c].sum())))
    cut_pairs = np.stack(cut, axis=1)
    tokens = (int(cut_pairs[:, 0].sum()), int(cut_pairs[:, 1].sum()))

    # pad_batches shuffles rows, so each [b, 2] batch keeps its pairs whole.
    batches = pad_batches(cut_pairs, batch_size, seed=seed)
    padded = tuple(int(sum(len(b) * b[:, c].max() for b in batches)) for c in range(2))
    rows = pack_pair_rows(cut_pairs, limits[0].max_len, limits[1].max_len)
    packed = (len(rows) * limits[0].max_len, len(rows) * limits[1].max_len)
    return PairAnalysis(
        summary=summarize_pairs(pairs),
        batch_size=batch_size,
        seed=seed,
        input=limits[0],
        target=limits[1],
        methods=[
            _method(
                "pad-random",
                f"shuffled micro-batches of {batch_size} pairs, padded to their longest input and target",
                len(batches),
                padded,
                tokens,
            ),
            _method(
                "pack",
                f"FFD rows of {limits[0].max_len} input + {limits[1].max_len} target tokens, pairs kept whole",
                len(rows),
                packed,
                tokens,
            ),
        ],
    )


def format_pair_analysis(a: PairAnalysis, name: str = "pairs") -> str:
    lines = [f"{name}: {a.summary['count']:,} (input, target) pairs", format_pair_summary(name, a.summary)]
    for side, limit in zip(SIDES, (a.input, a.target)):
        lines.append(
            f"max {side} {limit.max_len:,}"
            + (" (power of two >= p99)" if limit.max_len_is_default else "")
            + f": {limit.truncated:,} pairs truncated ({100 * limit.truncated_token_fraction:.2f}% of {side} tokens dropped)"
        )
    lines += ["", f"{'method':<12}{'units':>8}{'input pad':>11}{'target pad':>12}{'both':>8}  description"]
    for m in a.methods:
        lines.append(
            f"{m.name:<12}{m.units:>8,}{100 * m.input.padding_fraction:>10.1f}%"
            f"{100 * m.target.padding_fraction:>11.1f}%{100 * m.padding_fraction:>7.1f}%  {m.description}"
        )
    return "\n".join(lines)
