"""Held-out error of the T5 11B cost model's fits on the measured A100 tables (issue 27).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/heldout_t5.py [--json]

Each interior input length (encoder layer) and each interior (input, target) pair of lengths
(decoder layer) of every (tp, recompute) table is left out in turn and its points predicted from
the fits of the others (dyn_plugin.cost.encoder_decoder.held_out_pairs), for time and memory;
edge points (the largest micro-batch measured there, next to out of memory) are counted apart.
About a minute on the 2-core machine.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import numpy as np

from dyn_plugin.cost.bundled import MEASURED_DIR
from dyn_plugin.cost.encoder_decoder import held_out_pairs


def main() -> None:
    rows = held_out_pairs(MEASURED_DIR / "a100-t5-11b.json")
    if "--json" in sys.argv:
        for r in rows:
            print(json.dumps(r))
        return
    groups: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        if not r["edge"]:
            groups[(r["side"], r["metric"])].append(r["error"])
            groups[(r["side"], r["metric"], r["tp"], r["recompute"])].append(r["error"])
    print("side     metric        tp recompute  points  mean|err|  within 10%  worst under  worst over")
    for key, errs in sorted(groups.items(), key=lambda kv: (len(kv[0]), kv[0])):
        e = np.array(errs)
        tp, rc = (key[2], key[3]) if len(key) > 2 else ("all", "")
        print(
            f"{key[0]:8s} {key[1]:12s} {tp!s:>3s} {rc:10s} {len(e):6d} {np.abs(e).mean():9.1%} "
            f"{np.mean(np.abs(e) <= 0.10):10.0%} {min(e.min(), 0):11.1%} {max(e.max(), 0):10.1%}"
        )
    edge = [r["error"] for r in rows if r["edge"]]
    print(f"edge points (apart): {len(edge)}, {min(edge):+.0%}..{max(edge):+.0%}")


if __name__ == "__main__":
    main()
