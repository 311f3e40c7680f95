"""One transformer layer's activation memory read straight off measured tables (the DynaPipe
artifact's format, measured_tables.py), without any fit: to check what a plan's estimate says
against what the GPU measured."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np

from .measured_tables import MB


def _rows(table: dict[str, Any], key: str, name: str) -> dict[tuple[int, int], float]:
    return {(int(s), int(b)): float(v) for s, b, v in table[key].get(name, [])}


class MeasuredLayerMemory:
    """One transformer layer's activation memory read off the measured tables, independent of any
    fit: per sequence, the ``b = 1`` rows of ``stored_activation_mb`` and ``peak_activation_mb``
    (``sequence``). A micro-batch holds the sum over its sequences of both stored bytes and
    in-flight extra (peak minus stored): its sequences run the layer together, as a padded batch's
    rows do (the tables' ``b > 1`` rows are ``b`` times the ``b = 1`` row within a few percent);
    ``longest`` says where measurement stops."""

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
        """(stored, peak) bytes of one sequence of ``length`` tokens in one layer: the bytes per
        token run along straight lines between the measured lengths and on beyond the last two
        (a layer holding a + b*s bytes per token of an s-token sequence, as its attention matrices
        make it, is read exactly between and beyond its points); below the shortest measured
        length, the shortest's bytes per token."""
        if (tp, recompute) not in self.points:
            raise ValueError(f"{self.name}: no table for tp={tp}, recompute={recompute!r}")
        lens, stored, peak = self.points[(tp, recompute)]
        out = []
        for values in (stored, peak):
            per_token = [v / n for v, n in zip(values, lens)]
            if length <= lens[-1] or len(lens) < 2:
                out.append(length * float(np.interp(length, lens, per_token)))
                continue
            (a, b), (pa, pb) = lens[-2:], per_token[-2:]
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
