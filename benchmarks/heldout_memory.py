"""Held-out memory error of the bundled A100 tables' fits (issue 24, part 1).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/heldout_memory.py [--json]

Each measured length inside the range is left out in turn and predicted from the fits of the
others (dyn_plugin.cost.measured_tables.held_out_memory); edge points (the largest micro-batch
measured at a length) are summarised apart. Also prints the in-sample fit at the point the
issue cites (8192 tokens, full recompute, tp 1).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from dyn_plugin.cost.bundled import MEASURED_DIR
from dyn_plugin.cost.measured_tables import MB, held_out_memory, import_measured_tables
from dyn_plugin.cost.model import features
from dyn_plugin.cost.profile import cost_model_from_profile


def main() -> None:
    profile = import_measured_tables(MEASURED_DIR / "a100-gpt-6.7b.json", num_layers=32, hidden_size=4096)
    rows = held_out_memory(profile)
    if "--json" in sys.argv:
        for r in rows:
            print(json.dumps(r))
        return
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["metric"], r["tp"], r["recompute"], r["edge"])].append(r)
    print("metric       tp recompute  points  mean|err|  max|err|  worst under  (edge points)")
    for (metric, tp, rc, edge), rs in sorted(groups.items()):
        if edge:
            continue
        errs = [r["error"] for r in rs]
        ed = [r["error"] for r in groups.get((metric, tp, rc, True), [])]
        print(
            f"{metric:12s} {tp:2d} {rc:10s} {len(rs):6d} {sum(map(abs, errs)) / len(errs):9.1%} "
            f"{max(map(abs, errs)):9.1%} {min(min(errs), 0):11.1%}  "
            f"({len(ed)}: {min(ed, default=0):+.0%}..{max(ed, default=0):+.0%})"
        )
    interior = [abs(r["error"]) for r in rows if not r["edge"] and r["metric"] == "peak_bytes"]
    print(
        f"peak, all interior held-out points: {len(interior)}, within 5%: "
        f"{sum(e <= 0.05 for e in interior)}, max {max(interior):.1%}"
    )
    cm = cost_model_from_profile(profile)
    fit = cm.table("padded", "full", 1).fits["layer"]["peak_bytes"]
    cited = next(
        s for s in profile.samples if s.component == "layer" and (s.tp, s.recompute, s.seq_lens) == (1, "full", [8192])
    )
    print(
        f"in-sample, 8192 tokens x 1, full, tp1 peak: {fit(features([8192], 'padded')) / MB:,.0f} MB "
        f"(table: {cited.peak_bytes / MB:,.0f} MB)"
    )


if __name__ == "__main__":
    main()
