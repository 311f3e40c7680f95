"""``dynplugin shard``: search a per-module sharding plan (OSDP) and print it as a table."""

from __future__ import annotations

import argparse
import json
import logging
import os

from ..atomic import atomic_path
from ..cli_args import RANKS, SEED, input_file, output_file

HELP = "search a sharding choice per module under the memory budget (OSDP); print it as a table and write the plan JSON"

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="the model: a preset (tiny-llama, llama-350m, tiny-gpt2, tiny-t5) or a "
        "HF config.json; built on the meta device, no weights. An encoder-decoder (T5) is searched over "
        "(input, target) pairs, priced by the tables of pairs the config's cost_model.profile names",
    )
    parser.add_argument(
        "--config",
        required=True,
        type=input_file,
        help="DeepSpeed JSON config with a dyn_plugin section (sharding.memory_budget_mb, cluster, cost_model)",
    )
    parser.add_argument(
        "--lengths",
        help="lengths .npy/.json or a bundled distribution (default code; pairs for an encoder-decoder, "
        "default tasks); one global batch of it is the typical step the search prices",
    )
    parser.add_argument("--world", type=RANKS, help="ranks (default: cluster.devices_per_node * cluster.num_nodes)")
    parser.add_argument(
        "--host",
        choices=("fsdp2", "fsdp1", "zero3"),
        help="whose semantics price the choices (default: sharding.host, auto = fsdp2)",
    )
    parser.add_argument(
        "--out", default="shard-plan.json", type=output_file, help="where the plan JSON goes (default %(default)s)"
    )
    parser.add_argument(
        "--plot",
        metavar="PNG",
        type=output_file,
        help="the memory/time frontier the search explored, with the chosen point",
    )
    parser.add_argument("--seed", type=SEED, default=0)
    parser.add_argument("--json", action="store_true", help="print the plan JSON instead of the table")


def run(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..cost.from_config import build_cost_model, pair_cost_model
    from ..lengths.io import load_lengths
    from ..lengths.pairs import load_pairs
    from ..models.hf import hf_config, load_model_config
    from ..models.shard_units import config_units
    from ..runtime.sharding import search_for_run

    cfg = load_config(args.config)
    plugin = cfg.plugin
    model = hf_config(load_model_config(args.model))
    if model.is_encoder_decoder:  # searched over pairs, priced by the config's tables of pairs
        cost = pair_cost_model(plugin.cost_model, model)
        lengths = load_pairs(args.lengths or "tasks")
    else:
        cost = build_cost_model(plugin.cost_model, plugin.cluster)
        lengths = load_lengths(args.lengths or "code")
    world = args.world if args.world is not None else plugin.cluster.world_size
    host = args.host or (plugin.sharding.host if plugin.sharding.host != "auto" else "fsdp2")
    name, units = config_units(args.model)
    plan = search_for_run(units, plugin, cost, lengths, world=world, host=host, model=name, seed=args.seed)
    plan.save(args.out)
    if args.json:
        print(json.dumps(plan.to_dict()))
    else:
        print_plan(plan)
        print(f"plan -> {args.out}")
    if args.plot:
        plot_frontier(plan, args.plot)
        print(f"frontier -> {args.plot}")
    return 0


def print_plan(plan) -> None:
    """One row per unit, consecutive identical rows of decoder layers folded into one."""
    mb = 1 << 20
    print(
        f"{plan.model}: {plan.world} ranks, sharded over {plan.shard_size} ({plan.replicas} replica group(s)), "
        f"{plan.dtype}, {plan.host}; budget {plan.memory_budget_bytes / mb:,.0f} MB; typical step "
        f"{plan.micro_batches} micro-batches per rank"
    )
    print(f"{'module':<40}{'choice':<14}{'params':>12}{'MB each':>11}{'comm ms':>10}{'exposed ms':>11}")
    rows = [
        (u.name or "(root)", u.choice.label, u.params, u.memory_bytes / mb, u.comm_ms, u.exposed_ms) for u in plan.units
    ]
    for name, choice, params, mem, comm, exposed in _fold(rows):
        print(f"{name:<40}{choice:<14}{params:>12,}{mem:>11.1f}{comm:>10.1f}{exposed:>11.1f}")
    print(f"{'gather reserve':<66}{plan.gather_reserve_bytes / mb:>11.1f}")
    print(f"{'activations (typical step peak)':<66}{plan.activation_bytes / mb:>11.1f}")
    print(
        f"{'total (predicted peak)':<66}{plan.peak_bytes / mb:>11.1f}{sum(u.comm_ms for u in plan.units):>10.1f}"
        f"{plan.exposed_ms:>11.1f}"
    )
    print(
        f"simulated step: {plan.compute_ms:.1f} ms compute + {plan.exposed_ms:.1f} ms exposed communication = "
        f"{plan.step_ms:.1f} ms"
    )


def _fold(rows: list[tuple]) -> list[tuple]:
    """Units that differ only in their layer index and print the same fold into one row, e.g.
    'transformer.h.1-31.mlp x31', in the order they first appear."""
    import re

    groups: dict[tuple, list[str]] = {}
    for row in rows:
        m = re.search(r"\.(\d+)\.", row[0])
        key = (re.sub(r"\.(\d+)\.", ".#.", row[0], count=1),) + tuple(
            round(v, 1) if isinstance(v, float) else v for v in row[1:]
        )
        groups.setdefault(key, []).append(m.group(1) if m else "")
    folded = []
    for key, idx in groups.items():
        name = key[0].replace("#", _ranges([int(i) for i in idx])) if idx[0] else key[0]
        folded.append((name + (f" x{len(idx)}" if len(idx) > 1 else ""),) + key[1:])
    return folded


def _ranges(ints: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], ints[0]
    for a, b in zip(ints, ints[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ",".join(out)


def plot_frontier(plan, path: str) -> None:
    """Step time against peak memory per rank: the best the search found at each memory level
    (on the typical step it chose), the budget, and the point it chose."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mb = 1 << 20
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if plan.frontier:
        xs, ys = zip(*plan.frontier)
        ax.step(
            xs,
            ys,
            where="post",
            marker=".",
            label="frontier: fastest step within each peak memory (memory rounded up per module, as the knapsack counts it)",
        )
    ax.plot(
        [plan.peak_bytes / mb],
        [plan.step_ms],
        "o",
        color="crimson",
        label=f"chosen ({plan.peak_bytes / mb:,.0f} MB, {plan.step_ms:,.1f} ms)",
    )
    ax.axvline(plan.memory_budget_bytes / mb, color="gray", linestyle="--", label="memory budget")
    ax.set_xlabel("predicted peak memory per rank (MB)")
    ax.set_ylabel("simulated step (ms)")
    ax.set_title(f"{os.path.basename(plan.model)}: {plan.world} ranks, {plan.micro_batches} micro-batch(es) per rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
