"""Predicted against measured GPU memory, and the caching allocator's margin (issue 24, part 1).

Run on a CUDA device from the package root (PYTHONPATH set). Two parts, each written to --out as
it ends:

- ``heldout``: random micro-batches (packed and padded, every recompute mode, 1k-32k tokens) through
  the profiled model (``--profile``, measured on this GPU kind by ``dynplugin profile``), whole
  model with its loss: stored and peak activation bytes from ``torch.cuda.max_memory_allocated``
  (as the profiler measures them) against what the profile's cost model predicts.
- ``margin``: training steps of variable micro-batches with AdamW in a fresh process per allocator
  setting; per step the peak bytes tensors held (allocated) and the peak the caching allocator
  held from the driver (reserved). reserved / allocated - 1 is what fragmentation adds above
  what the planner prices: the safety margin a plan needs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

from dyn_plugin.cost.model import StageSpec
from dyn_plugin.cost.profile import cost_model_from_profile, load_profile
from dyn_plugin.device import DTYPES
from dyn_plugin.models.hf import build_causal_lm
from dyn_plugin.models.recompute import RecomputeSwitch
from dyn_plugin.profiling.device import measures
from dyn_plugin.profiling.workload import backward, loss_closure, make_inputs

MB = 2**20
DEVICE = os.environ.get("CHECK_DEVICE", "cuda")  # cpu: the heldout part, on a profile measured on CPU


def model_and_cost(profile_path: str):
    profile = load_profile(profile_path)
    torch.manual_seed(0)
    # in the precision the profile was measured in (bf16 on the GPU)
    model = build_causal_lm(profile.model.config).to(DEVICE, DTYPES[profile.device.dtype or "bf16"]).train()
    return model, RecomputeSwitch(model), cost_model_from_profile(profile), profile


def random_lengths(rng, tokens: int, max_len: int) -> list[int]:
    lens, left = [], tokens
    while left > 0:
        lens.append(int(min(left, max_len, max(16, rng.lognormal(6.5, 1.2)))))
        left -= lens[-1]
    return lens


def heldout(args) -> dict:
    model, switch, cost, profile = model_and_cost(args.profile)
    vocab, rng, cases = model.config.vocab_size, np.random.default_rng(7), []
    modes = tuple(profile.grid["recomputes"])  # those the profile measured
    for i in range(args.cases):
        layout, mode = ("packed", "padded")[i % 2], modes[(i // 2) % len(modes)]
        tokens = int(rng.choice([1, 4, 8, 16, 32])) * args.max_tokens // 32
        if layout == "packed":
            lens = random_lengths(rng, tokens, args.max_len)
        else:
            width = min(tokens, args.max_len, int(rng.choice([512, 1024, 2048, 4096, 8192])))
            lens = [int(x) for x in rng.integers(width // 2, width + 1, size=max(1, tokens // width))]
            lens[0] = width
        inputs = make_inputs(lens, layout, vocab, 8, rng).to(DEVICE)
        switch.set(mode)
        probe = measures(DEVICE)[1]
        probe(loss_closure(model, inputs), backward)  # gradients allocated once
        model.zero_grad(set_to_none=False)
        stored, peak = probe(loss_closure(model, inputs), backward)
        model.zero_grad(set_to_none=False)
        pred = cost.micro_batch_cost(lens, layout=layout, recompute=mode, stage=StageSpec(cost.num_layers))
        cases.append(
            {
                "layout": layout,
                "recompute": mode,
                "tokens": sum(lens),
                "sequences": len(lens),
                "longest": max(lens),
                "measured_stored_mb": stored / MB,
                "predicted_stored_mb": pred.stored_bytes / MB,
                "measured_peak_mb": peak / MB,
                "predicted_peak_mb": pred.peak_bytes / MB,
                "peak_error": pred.peak_bytes / peak - 1,
                "extrapolated": pred.extrapolated,
            }
        )
        print(json.dumps(cases[-1]), flush=True)
    errors = [abs(c["peak_error"]) for c in cases]
    return {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
        "torch": torch.__version__,
        "model": profile.model.name,
        "cases": cases,
        "peak_error_mean": float(np.mean(errors)),
        "peak_error_max": float(np.max(errors)),
        "worst_underestimate": float(min(c["peak_error"] for c in cases)),
    }


def margin_run(args) -> dict:
    """One allocator setting (PYTORCH_CUDA_ALLOC_CONF from the environment): variable steps; with
    ``--cap-mb`` the allocator may hold no more than that (``set_per_process_memory_fraction``):
    does the run still fit, and how often did the allocator free its cache and retry?"""
    if args.cap_mb:
        torch.cuda.set_per_process_memory_fraction(args.cap_mb * MB / torch.cuda.get_device_properties(0).total_memory)
    try:
        return _steps(args)
    except torch.OutOfMemoryError as exc:
        return {
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "cap_mb": args.cap_mb,
            "oom": str(exc)[:300],
        }


def _steps(args) -> dict:
    model, switch, cost, _ = model_and_cost(args.profile)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab, rng, steps = model.config.vocab_size, np.random.default_rng(11), []
    t0 = time.time()
    for _ in range(args.steps):
        torch.cuda.reset_peak_memory_stats()
        predicted = 0.0
        for _ in range(4):  # micro-batches of one step: lengths, token counts and recompute all vary
            mode = str(rng.choice(["none", "selective", "full"]))
            lens = random_lengths(rng, int(rng.choice([2048, 8192, 16384, 32768])), 8192)
            switch.set(mode)
            inputs = make_inputs(lens, "packed", vocab, 8, rng).to("cuda")
            loss_closure(model, inputs)().backward()
            c = cost.micro_batch_cost(lens, layout="packed", recompute=mode, stage=StageSpec(cost.num_layers))
            predicted = max(predicted, c.peak_bytes)
        opt.step()
        opt.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        steps.append(
            {
                "allocated_peak_mb": torch.cuda.max_memory_allocated() / MB,
                "reserved_peak_mb": torch.cuda.max_memory_reserved() / MB,
                "predicted_activation_peak_mb": predicted / MB,
                "alloc_retries": stats.get("num_alloc_retries", 0),
            }
        )
    states = torch.cuda.memory_allocated() / MB  # weights, gradients and AdamW's moments, between steps
    return {
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "cap_mb": args.cap_mb,
        "oom": None,
        "allocated_peak_mb": max(s["allocated_peak_mb"] for s in steps),
        "reserved_peak_mb": max(s["reserved_peak_mb"] for s in steps),
        "steps": steps,
        "states_mb": states,
        # the cache is kept between steps, so reserved only grows: its peak against the run's
        "reserved_over_allocated": max(s["reserved_peak_mb"] for s in steps)
        / max(s["allocated_peak_mb"] for s in steps)
        - 1,
        "alloc_retries": steps[-1]["alloc_retries"],
        "seconds": time.time() - t0,
    }


def margin(args) -> dict:
    """Per allocator setting: uncapped, then capped at the uncapped run's peak of tensor bytes
    (which the planner prices) plus each of ``--caps`` (fractions): the least headroom that runs."""
    runs = []
    for conf in ("", "expandable_segments:True"):
        free = _run(args, conf, 0.0)
        runs.append(free)
        for extra in args.caps:
            if free.get("allocated_peak_mb"):
                runs.append({**_run(args, conf, free["allocated_peak_mb"] * (1 + extra)), "headroom": extra})
    return {"runs": runs}


def _run(args, conf: str, cap_mb: float) -> dict:
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
    cmd = [sys.executable, __file__, "--part", "margin-run", "--profile", args.profile, "--steps", str(args.steps)]
    out = subprocess.run([*cmd, "--cap-mb", str(cap_mb)], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode:
        run = {"alloc_conf": conf, "cap_mb": cap_mb, "error": out.stderr[-3000:]}
    else:
        run = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps({k: v for k, v in run.items() if k != "steps"}), flush=True)
    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--profile", default="benchmarks/gpu-2026-11-26/profile.json")
    p.add_argument("--part", default="heldout,margin")
    p.add_argument("--cases", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--cap-mb", type=float, default=0.0)
    p.add_argument("--caps", type=lambda v: [float(x) for x in v.split(",")], default=[0.0, 0.01, 0.03])
    p.add_argument("--out", default="out/gpu-memory")
    args = p.parse_args()
    if args.part == "margin-run":
        print(json.dumps(margin_run(args)))
        return
    os.makedirs(args.out, exist_ok=True)
    for part in args.part.split(","):
        result = {"heldout": heldout, "margin": margin}[part](args)
        with open(os.path.join(args.out, f"{part}.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
