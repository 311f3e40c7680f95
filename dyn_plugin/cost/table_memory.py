"""One transformer layer's activation memory read straight off measured tables (the DynaPipe
artifact's format, measured_tables.py), without any fit: to check what a plan's estimate says
against what the GPU measured."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np

MB = 1 << 20


def _rows(table: dict[str, Any], key: str, name: str) -> dict[tuple[int, int], float]:
    return {(int(s), int(b)): float(v) for s, b, v in table[key].get(name, [])}


class MeasuredLayerMemory:
    """One transformer layer's activation memory read off the measured tables, independent of any
    fit: per sequence, the ``b = 1`` rows of ``stored_activation_mb`` and ``peak_activation_mb``,
    linear between measured lengths (the points rise convexly in the length, so the line between
    two lies on or above the truth: conservative), the shortest measured length's below it. A
    micro-batch holds the sum over its sequences of both stored bytes and in-flight extra (peak
    minus stored): its sequences run the layer together, as a padded batch's rows do (the tables'
    ``b > 1`` rows are ``b`` times the ``b = 1`` row within a few percent). Beyond the longest
    measured length the bytes per token run on along the line through the last two lengths' (a
    layer holding a + b*s per token of an s-token sequence, as the tables' attention matrices make
    it, is extrapolated exactly); ``longest`` says where measurement stops."""

    def __init__(self, source: str | os.PathLike | dict[str, Any]) -> None:
        if isinstance(source, dict):
            raw = source
        else:
            with open(source) as f:
                raw = json.load(f)
        self.name = raw.get("name", "measured tables")
        self.points: dict[tuple[int, str], tuple[list[int], list[float], list[float]]] = {}
        for t in raw["tables"]:
            stored = _rows(t, "stored_activation_mb", "encoder")
            peak = _rows(t, "peak_activation_mb", "encoder")
            lens = sorted(s for s, b in stored.keys() & peak.keys() if b == 1)
            if lens:
                self.points[(int(t["tp"]), t["recompute"])] = (
                    lens,
                    [stored[(s, 1)] * MB for s in lens],
                    [max(peak[(s, 1)], stored[(s, 1)]) * MB for s in lens],
                )

    def sequence(self, length: int, recompute: str, tp: int = 1) -> tuple[float, float]:
        """(stored, peak) bytes of one sequence of ``length`` tokens in one layer."""
        if (tp, recompute) not in self.points:
            raise ValueError(f"{self.name}: no table for tp={tp}, recompute={recompute!r}")
        lens, stored, peak = self.points[(tp, recompute)]
        if length <= lens[-1] or len(lens) < 2:
            return float(np.interp(length, lens, stored)), float(np.interp(length, lens, peak))
        (a, b), out = lens[-2:], []
        for values in (stored, peak):
            pa, pb = values[-2] / a, values[-1] / b
            out.append(length * (pb + max(0.0, (pb - pa) / (b - a)) * (length - b)))
        return out[0], out[1]

    def longest(self, recompute: str, tp: int = 1) -> int:
        """The longest sequence measured under ``recompute`` at ``tp``."""
        return self.points[(tp, recompute)][0][-1]

    def micro_batch(self, seq_lens: Sequence[int], recompute: str, tp: int = 1) -> tuple[float, float]:
        """(stored, in-flight extra) bytes of one layer running ``seq_lens`` together."""
        stored = extra = 0.0
        for s in seq_lens:
            st, pk = self.sequence(int(s), recompute, tp)
            stored += st
            extra += pk - st
        return stored, extra
