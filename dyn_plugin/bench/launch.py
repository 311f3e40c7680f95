"""The side-by-side training benchmarks' launch (``bench train``, ``bench shard --train``): a host's
module on local ranks (torchrun), which trains every batching or plan, prints the table and writes
the report; then its summary rows, read back.

Who shows the results: without ``--json`` the ranks' table and where the report files are, and no
records; with ``--json`` the records alone (one per summary row), the ranks' output left out."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def launch_comparison(module: str, benchmark: str, args: argparse.Namespace, extra: list[str]) -> list[dict]:
    """Run ``module`` on ``args.ranks`` local ranks writing into ``args.out``; with ``--json``, each
    row of its summary.json as a record (``benchmark``, the cost model that priced the plans)."""
    from .train_common import cost_model_label

    cmd = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={args.ranks}",
            "-m",
            module,
            "--out",
            args.out,
            "--steps",
            str(args.steps),
        ]
        + extra
        + (["--profile", args.profile] if args.profile else [])
    )
    cost_model = cost_model_label(args.profile)
    if not args.json:
        print(
            f"cost model: {cost_model}"
            + (
                ""
                if args.profile
                else "; measure one with `dynplugin profile` and pass --profile for predictions of this machine"
            ),
            flush=True,  # before the ranks' output, which goes straight to the same stdout
        )
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL if args.json else None)
    if done.returncode != 0:
        raise RuntimeError(f"{benchmark} comparison failed (exit {done.returncode}): {' '.join(cmd)}")
    if not args.json:
        return []
    with open(os.path.join(args.out, "summary.json")) as f:
        return [{"benchmark": benchmark, "cost_model": cost_model, **row} for row in json.load(f)]
