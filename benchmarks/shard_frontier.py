"""Per-module sharding (OSDP) against the uniform strategies on the memory / step-time plane
(issue 24, section 3): why no per-module plan beats the best uniform one by 1.1x.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/shard_frontier.py [--out PNG] [--json JSONL]

Setups as ``dynplugin bench shard`` (bench/shard.py): the same cluster, global batch and pricing.
For each model on two nodes (16 A100s) and each budget on a grid, the searched plan (``osdp``)
and every uniform plan a user could tune (one choice for every module, sharded over the world or a
node: FSDP's FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2, and FSDP2's
reshard_after_forward=2/4/8 and keep), each a point (predicted peak, simulated step).

And a lower bound on any per-module plan's step under the budget, term by term: the step is
the typical step's compute (planned with the plan's model states, or more), plus the optimizer
update, plus the communication compute does not hide. The bound takes the least compute the
step planner gives over model-state budgets from the least any plan holds (every unit sharded
over the world) to the most the budget leaves beside the longest sequence alone (48 points),
the least optimizer time per unit over every choice, and no exposed communication at all.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from dyn_plugin.bench.shard import GPT_48L, example_config, plugin_config
from dyn_plugin.cost.from_config import build_cost_model
from dyn_plugin.lengths.io import cap_lengths, load_lengths
from dyn_plugin.models.shard_units import config_units
from dyn_plugin.plan.sharding.search import RESOLUTION, _Search, choice_columns, search_sharding, smallest, uniform_plan
from dyn_plugin.plan.sharding.shard_plan import MB
from dyn_plugin.runtime.sampler import global_batches

# FSDP's names for some uniform plans (choice label / shard size); the others are labelled so
NAMED = {
    "full/16": "full_shard",
    "grad_op/16": "shard_grad_op",
    "replicate/16": "no_shard",
    "full/8": "hybrid_shard",
    "grad_op/8": "hybrid_shard_zero2",
    "reshard(8)/16": "full_shard, reshard_after_forward=8",
}
GRID = 48


def points(setup: str, gpus: int, budgets: list[float], units, lengths) -> list[dict]:
    out = []
    for budget in budgets:
        config = plugin_config(setup, gpus, budget, 16384, 8192)
        ids = global_batches(lengths, config.microbatching.global_tokens, 1, 0)[0]
        batch = [int(lengths[i]) for i in ids]
        cost = build_cost_model(config.cost_model, config.cluster)
        node = config.cluster.devices_per_node
        base = {"model": setup, "gpus": gpus, "memory_budget_mb": budget}
        kw = dict(world=gpus, lengths=batch, model=setup, longest=int(lengths.max()))
        for n in (gpus, node):
            for choice in choice_columns(config, "fsdp2", n):
                if choice.kind == "split":
                    continue
                method = f"{choice.label}/{n}"
                try:
                    p = uniform_plan(units, cost, config, choice, shard_size=n, **kw)
                except ValueError:
                    out.append({**base, "method": method, "uniform": True, "fits": False})
                    continue
                out.append({**row(base, method, p), "uniform": True})
        try:
            out.append(row(base, "osdp", search_sharding(units, cost, config, **kw)))
        except ValueError:
            out.append({**base, "method": "osdp", "fits": False})
            continue
        out.append({**base, "method": "bound", "fits": True, **bound(units, cost, config, batch, kw["longest"])})
    return out


def row(base: dict, method: str, p) -> dict:
    return {
        **base,
        "method": method,
        "fits": True,
        "peak_mem_mb": p.peak_bytes / MB,
        "sim_iter_ms": p.step_ms,
        "compute_ms": p.compute_ms,
        "exposed_ms": p.exposed_ms,
        "micro_batches": p.micro_batches,
        "shard_size": p.shard_size,
        "state_mb": p.state_bytes / MB,
        "activation_mb": p.activation_bytes / MB,
    }


def bound(units, cost, config, batch, longest) -> dict:
    """The least step any per-module plan can have under the budget (module docstring)."""
    search = _Search(
        units,
        cost,
        config,
        world=config.cluster.world_size,
        lengths=batch,
        host="fsdp2",
        model="",
        native=True,
        resolution=RESOLUTION,
        longest=longest,
    )
    world = config.cluster.world_size
    least, opt = math.inf, math.inf
    for n in (world, config.cluster.devices_per_node):
        cols = choice_columns(config, "fsdp2", n)
        memory = search.prices(None, n, cols)
        least = min(least, smallest(memory)[0])
        opt = min(opt, float(np.where(memory.allowed, memory.optimizer_ms, np.inf).min(axis=1).sum()))
    top = search.budget - search.least_activation
    best = None
    for state in np.linspace(least, top, GRID):
        try:
            typ = search.step(float(state))
        except ValueError:
            continue
        if best is None or typ.compute_ms < best.compute_ms:
            best = typ
    return {
        "sim_iter_ms": best.compute_ms + search.optimizer_fixed_ms + opt,
        "compute_ms": best.compute_ms,
        "optimizer_ms": search.optimizer_fixed_ms + opt,
        "micro_batches": best.micro_batches,
        "state_mb": best.state_bytes / MB,
        "activation_mb": best.activation_bytes / MB,
        "least_state_mb": least / MB,
    }


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5))
    axes = np.atleast_1d(axes)
    style = {
        "full/16": ("v", "tab:red"),
        "grad_op/16": ("^", "tab:orange"),
        "replicate/16": ("s", "tab:brown"),
        "full/8": ("D", "tab:blue"),
        "grad_op/8": ("d", "tab:cyan"),
        "reshard(8)/16": ("P", "tab:olive"),
    }
    for ax, model in zip(axes, models):
        mine = [r for r in rows if r["model"] == model and r["fits"]]
        other = sorted(
            (r["peak_mem_mb"] / 1000, r["sim_iter_ms"]) for r in mine if r.get("uniform") and r["method"] not in style
        )
        if other:
            ax.scatter(*zip(*other), marker=".", color="silver", label="other uniform (keep, reshard(2/4), ...)")
        for method, (marker, color) in style.items():
            pts = sorted((r["peak_mem_mb"] / 1000, r["sim_iter_ms"]) for r in mine if r["method"] == method)
            if pts:
                ax.scatter(*zip(*pts), marker=marker, color=color, label=f"{method}: {NAMED[method]}", s=28)
        pts = sorted((r["peak_mem_mb"] / 1000, r["sim_iter_ms"]) for r in mine if r["method"] == "osdp")
        if pts:
            ax.scatter(*zip(*pts), marker="o", facecolors="none", edgecolors="black", s=70, label="osdp (per module)")
        # the best uniform plan within each budget, and the bound on any plan within it
        budgets = sorted({r["memory_budget_mb"] for r in mine})
        best = [
            (b / 1000, min(r["sim_iter_ms"] for r in mine if r["memory_budget_mb"] == b and r.get("uniform")))
            for b in budgets
            if any(r["memory_budget_mb"] == b and r.get("uniform") for r in mine)
        ]
        if best:
            ax.step(*zip(*best), where="post", color="tab:blue", alpha=0.5, label="best uniform within the budget")
            ax.step(
                [b for b, _ in best],
                [t / 1.1 for _, t in best],
                where="post",
                color="tab:green",
                ls=":",
                label="best uniform / 1.1 (the target)",
            )
        lb = sorted((r["memory_budget_mb"] / 1000, r["sim_iter_ms"]) for r in mine if r["method"] == "bound")
        if lb:
            ax.step(*zip(*lb), where="post", color="tab:purple", ls="--", label="bound: least compute, no exposed comm")
        ax.set_title(f"{model}, 16 A100s (two nodes)")
        ax.set_xlabel("peak memory per GPU (GB; bound and budget lines: the budget)")
        ax.set_ylabel("simulated step (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/shard-frontier-2026-11-26.png")
    ap.add_argument("--json", default="benchmarks/shard-frontier-2026-11-26.jsonl")
    ap.add_argument("--budgets-mb", default="22000,24000,26000,28000,30000,32000,34000,36000,38000,40000")
    args = ap.parse_args()
    budgets = [float(b) for b in args.budgets_mb.split(",")]
    lengths = cap_lengths(load_lengths("code"), 8192, True)
    units = {"gpt-48l": config_units(GPT_48L)[1], "gpt-6.7b": config_units(example_config("gpt-6.7b.json"))[1]}
    rows = []
    for setup in ("gpt-48l", "gpt-6.7b"):
        rows += points(setup, 16, budgets, units[setup], lengths)
    with open(args.json, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    plot(rows, args.out)
    for b in budgets:
        for setup in ("gpt-48l", "gpt-6.7b"):
            mine = {r["method"]: r for r in rows if r["model"] == setup and r["memory_budget_mb"] == b and r["fits"]}
            uni = {m: r for m, r in mine.items() if r.get("uniform")}
            if "osdp" not in mine or not uni:
                print(setup, b, "nothing fits" if "osdp" not in mine else "no uniform fits")
                continue
            name, u = min(uni.items(), key=lambda kv: kv[1]["sim_iter_ms"])
            o, lb = mine["osdp"], mine["bound"]
            print(
                f"{setup} {b:.0f}: best uniform {name} {u['sim_iter_ms']:.0f} (compute {u['compute_ms']:.0f}, exposed "
                f"{u['exposed_ms']:.0f}, {u['micro_batches']} mb), osdp {o['sim_iter_ms']:.0f} (compute "
                f"{o['compute_ms']:.0f}, exposed {o['exposed_ms']:.0f}, {o['micro_batches']} mb) = "
                f"{u['sim_iter_ms'] / o['sim_iter_ms']:.3f}x; bound {lb['sim_iter_ms']:.0f} (compute "
                f"{lb['compute_ms']:.0f}, {lb['micro_batches']} mb) = at most {u['sim_iter_ms'] / lb['sim_iter_ms']:.3f}x"
            )


if __name__ == "__main__":
    main()
