"""``dynplugin bench WHAT``: benchmarks that print JSON (figures go into BENCHMARKS.md).

Each benchmark is a module of dyn_plugin/bench that owns its sub-command: ``HELP`` (its line in
``dynplugin bench --help``), ``add_arguments(parser)`` (its flags) and ``run(args)`` (the records to
print). This command registers them, adds the flag they share (``--json``) and prints each record
with the machine it ran on."""

from __future__ import annotations

import argparse
import json
import platform
import time

from ..bench import checkpoint, cost, families, loader, planner, shard, sp, start_check, strategy, train

HELP = (
    "benchmarks that print JSON: cost (cost-model evaluation), planner (plans vs baselines on A100 costs), "
    "sp (dynamic sequence parallelism vs fixed and bucketed sizes, simulated), "
    "shard (the per-module sharding search vs FSDP's uniform strategies, simulated), "
    "strategy (Hydraulis's heterogeneous strategies vs the seed's stage 1, homogeneous and DynaPipe, simulated), "
    "loader (planning ahead, plan wait, store latency), train (DeepSpeed or Megatron on 2 CPU ranks, batchings "
    "side by side), families (each model family's step, predicted from a profile of another, against measured), "
    "checkpoint (what the checkpoint protocol's hashes cost: sealing a save, verifying a resume), "
    "start-check (what the start-up check costs per host at a 1.1B-parameter shape)"
)
# WHAT -> the module that owns it, in the order `dynplugin bench --help` lists them
BENCHMARKS = {
    "cost": cost,
    "planner": planner,
    "sp": sp,
    "shard": shard,
    "strategy": strategy,
    "loader": loader,
    "train": train,
    "checkpoint": checkpoint,
    "start-check": start_check,
    "families": families,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", required=True, metavar="WHAT")
    for name, module in BENCHMARKS.items():
        bench = sub.add_parser(name, help=module.HELP)
        module.add_arguments(bench)
        bench.add_argument("--json", action="store_true", help="one JSON object per line, no indentation")
        bench.set_defaults(bench=module.run)


def run(args: argparse.Namespace) -> int:
    host = dict(machine=platform.machine(), python=platform.python_version(), date=time.strftime("%Y-%m-%d"))
    for record in args.bench(args):
        print(json.dumps({**record, **host}, indent=None if args.json else 2), flush=True)
    return 0
