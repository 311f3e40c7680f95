"""Train a Llama with DeepSpeed, five ways side by side, on real code.

    torchrun --nproc_per_node=2 -m dyn_plugin.bench.train_deepspeed --profile out/profile.json --out out/train

Ranks run on CPU (gloo, fp32) or, where CUDA is available, one GPU each (NCCL) in the profile's
precision (bf16 or fp16 through DeepSpeed's mixed-precision section, a torch AdamW stepping the
fp32 master weights, so that no DeepSpeed op is compiled).

(``dynplugin bench train`` launches it, and with ``--json`` prints the summary as JSON; ``make demo`` runs it.)

Modes: padded (every sequence padded to the maximum length, a fixed number per micro-batch:
Megatron's default), token_budget (DeepSpeed's batch_by_seqlens), packing (fixed-length rows of
the maximum length, attention across the documents of a row: Megatron's packing),
packing_varlen (the same rows with per-document attention: the strongest baseline) and
dyn_plugin (the plugin's plan). Each trains the same model from the same initial weights on
the same global batches (the Python standard library's source, tokenized with the plugin's
offline BPE), so only the batching differs. Rank 0 prints one table and writes report.md,
report.png and records.jsonl. On a GPU each step also records its model FLOPs utilisation and
rank 0's peak memory, measured by torch and predicted by the plan (``bench/utilization.py``).
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from tqdm import tqdm

import deepspeed_ext

from ..atomic import write_json_atomic
from ..cost.shape import shape_from_config
from ..models.hf import build_causal_lm, load_model_config
from ..plan.steps.simulator import simulate
from .train_common import (
    add_background_load_argument,
    add_model_argument,
    batchings_preamble,
    common_parser,
    cost_model_section,
    finish_batchings,
    profile_dtype,
    ranks_on,
    step_record,
    timed_step,
    tokenized_corpus,
    use_rank_device,
)
from .utilization import measured_peak_mb, mfu, model_flops, peak_tflops, start_peak

# mode -> what it changes in the dyn_plugin section
MODES = {
    "padded": {"microbatching": {"method": "fixed_padding"}},
    "token_budget": {"microbatching": {"method": "token_budget"}},
    "packing": {"microbatching": {"method": "packing_full"}},
    "packing_varlen": {"microbatching": {"method": "packing_varlen"}},
    "dyn_plugin": {"microbatching": {"method": "dynapipe"}},
    # the plugin planning every step from the profile alone (no online calibration), beside dyn_plugin
    "dyn_plugin_static": {"microbatching": {"method": "dynapipe"}, "calibration": {"enabled": False}},
    # --stages > 1: the plugin's micro-batches under plain 1F1B, beside dyn_plugin's chosen (zero-bubble) schedules
    "dyn_plugin_1f1b": {"microbatching": {"method": "dynapipe"}, "pipeline": {"schedule": "1f1b"}},
    # --sp: sequences split over the 2 ranks where it pays (dynamic), always (fixed), never (full recompute instead)
    "sp_dynamic": {"sequence_parallel": {"enabled": True, "sizes": [1, 2]}},
    "sp_fixed": {"sequence_parallel": {"enabled": True, "sizes": [2]}},
    "sp1_full": {"microbatching": {"recompute": "full"}},
}
SP_MODES = ("sp_dynamic", "sp_fixed", "sp1_full")
PIPELINE_MODES = ("dyn_plugin_1f1b",)
CALIBRATION_MODES = ("dyn_plugin_static",)  # by default under --background-load only
BASELINES = (
    "padded",
    "packing",
    "packing_varlen",
    "sp_fixed",
    "sp1_full",
    "dyn_plugin_1f1b",
    "dyn_plugin_static",
)  # the ratios the report shows


def precision_section(dtype: str) -> dict:
    """DeepSpeed's mixed-precision section for a cost-model dtype (fp32 needs none)."""
    return {} if dtype == "fp32" else {dtype: {"enabled": True}}


def device_memory_mb(device: torch.device) -> int:
    """The memory the planner may fill: the GPU's, or what the CPU demo plans against."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory // 2**20)
    return 8000


def split_memory_mb(profile: str, max_len: int, ranks: int) -> float:
    """Device memory at which a ``max_len`` sequence fits one rank only with full recompute (10%
    above its peak there), so the SP modes face the choice the comparison is about: split the
    longest sequences over ranks, or recompute them."""
    from ..config import DeviceSpec
    from ..cost.profile import cost_model_from_profile, load_profile

    cost = cost_model_from_profile(load_profile(profile))
    peak = cost.micro_batch_cost([max_len], layout="packed", recompute="full").peak_bytes
    states = cost.model_state_bytes(zero_stage=1, dp=ranks).total
    return (1.1 * peak + states) * DeviceSpec().memory_mb / DeviceSpec().plannable_mb / 2**20


def run_mode(mode: str, args, docs, lengths, device: torch.device, dtype: str) -> list[dict]:
    section = {
        "cost_model": cost_model_section(args.profile, dtype),
        "microbatching": {"global_tokens": args.global_tokens, "max_seq_len": args.max_len},
        "cluster": {
            "devices_per_node": dist.get_world_size(),
            "device": {"memory_mb": args.memory_mb or device_memory_mb(device)},
        },
    }
    if args.stages > 1:  # the plugin's plans choose their schedules, split backwards included
        section["pipeline"] = {"stages": args.stages, "schedule": "zero_bubble"}
    for key, values in MODES[mode].items():
        section[key] = {**section.get(key, {}), **values}
    config = {
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        **precision_section(dtype),
        "dyn_plugin": section,
    }
    torch.manual_seed(0)
    model = build_causal_lm(load_model_config(args.model))
    engine, _, loader, _ = deepspeed_ext.initialize(
        model=model,
        config=config,
        dataset=[{"input_ids": d} for d in docs],
        lengths=lengths,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),  # a pipeline stage holds a part of them
        seed=args.seed,
    )
    records = []
    total = args.warmup + args.steps
    shape, tflops = shape_from_config(model.config), peak_tflops(device, dtype)
    bar = tqdm(total=total, desc=f"{mode:>12}", disable=dist.get_rank() != 0)
    # a pipeline's micro-batches overlap: no per-micro-batch timings, and its stages count its samples once
    pipelined = args.stages > 1
    counting = not pipelined or engine.is_first_stage()
    for n, step in enumerate(loader):
        # every rank of a sequence-parallel group lists the group's samples: count them on its first shard only
        mine = [len(docs[i]) for mb, (_, _, index) in zip(step.sample_ids, step.shards) if index == 0 for i in mb]
        mine = mine if counting else []
        slots = sum(int(m["input_ids"].numel()) for m in step.micro_batches) if counting else 0
        # a pipeline's instructions are timed for one step's trace only; data parallel: every step (the calibration's)
        traced = n == args.warmup and mode in ("dyn_plugin", "dyn_plugin_1f1b")
        timings: list | None = [] if traced or not pipelined else None
        start_peak(device)
        counts = (sum(mine), slots, model_flops(shape, mine))
        ms, loss, (real, slots, flops) = timed_step(engine, step, device, counts, timings)
        bar.update()
        if traced and pipelined:
            write_pipeline_trace(step, timings, loader.context, os.path.join(args.out, f"pipeline-trace-{mode}.json"))
        elif traced and mode == "dyn_plugin":
            write_step_trace(step, timings, loader.context.cost, args.out, device)
        if n >= args.warmup:
            gpu = {
                "mfu": mfu(flops, ms, dist.get_world_size(), tflops),
                "peak_mb_measured": measured_peak_mb(device),
                "peak_mb_predicted": step.predicted_peak_mb,
            }
            records.append(step_record(mode, n, step, ms, real, slots, loss, **gpu))
        if n + 1 == total:
            break
    bar.close()
    # DeepSpeed's teardown: its ZeRO optimizer's gradient hooks sit on the parameters' C++ gradient
    # accumulators, a cycle through the engine that no collection frees (16 GiB kept per mode for a
    # 1.2B model on the H200, the fifth mode out of memory)
    engine.destroy()
    return records


def release_device_memory(device: torch.device, mode: str) -> None:
    """Free what a finished (and destroyed) mode left before the next plans against the whole GPU:
    its engine and optimizer sit in reference cycles that only a collection frees; the line printed
    says what is left."""
    if device.type != "cuda":
        return
    gc.collect()
    torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        print(f"after {mode}: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB still allocated", flush=True)


def write_step_trace(step, timings: list, cost, out: str, device: torch.device) -> None:
    """Chrome trace of one executed step: per rank, measured forward/backward of each
    micro-batch next to the cost model's prediction for it (open in https://ui.perfetto.dev)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = []
    for k, desc in enumerate(step.loaded):  # in run order
        c = cost.micro_batch_cost(desc.seq_lens, layout=desc.layout, recompute=desc.recompute)
        fwd, bwd = timings[k]
        mine += [fwd, bwd, c.forward_ms, c.backward_ms]
    mine.append(timings[-1][1])  # optimizer step
    width = torch.tensor([len(mine)], device=device)
    widths = [torch.zeros_like(width) for _ in range(world)]
    dist.all_gather(widths, width)
    padded = torch.zeros(int(max(widths)), dtype=torch.float64, device=device)
    padded[: len(mine)] = torch.tensor(mine, dtype=torch.float64)
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    if rank != 0:
        return
    events = []
    for r, (vals, w) in enumerate(zip(gathered, widths)):
        vals = vals[: int(w)].tolist()
        events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
        for tid, name in ((0, "measured"), (1, "predicted")):
            events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": name}})
        clocks = [0.0, 0.0]
        for m in range((len(vals) - 1) // 4):
            f, b, pf, pb = vals[4 * m : 4 * m + 4]
            for tid, (fwd, bwd) in enumerate(((f, b), (pf, pb))):
                for kind, dur in (("F", fwd), ("B", bwd)):
                    events.append(
                        {
                            "ph": "X",
                            "name": f"{kind}{m}",
                            "pid": r,
                            "tid": tid,
                            "ts": clocks[tid] * 1e3,
                            "dur": dur * 1e3,
                            "args": {"micro_batch": m},
                        }
                    )
                    clocks[tid] += dur
        events.append(
            {
                "ph": "X",
                "name": "optimizer step + all-reduce",
                "pid": r,
                "tid": 0,
                "ts": clocks[0] * 1e3,
                "dur": vals[-1] * 1e3,
            }
        )
    write_json_atomic(os.path.join(out, "step-trace.json"), {"traceEvents": events, "displayTimeUnit": "ms"})


def write_pipeline_trace(step, timings: list, context, path: str) -> None:
    """Chrome trace of one executed pipeline step (open in https://ui.perfetto.dev): per rank, the
    compute instructions it ran (``PlanPipelineEngine.train_batch``'s timings: the gaps are its
    waits), above the simulated schedule of its replica at its stage, as planned."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (step.plan.stage, step.plan.column, timings))
    if dist.get_rank() != 0:
        return
    plan = context.step_plan(step.epoch, step.index)
    simulated = {}
    for replica in plan.replicas:
        result = simulate(replica.micro_batches, replica.schedule, context.spec.link, record=True)
        for column in replica.columns:
            simulated[column] = result.events
    events: list[dict] = []
    for rank, (stage, column, ops) in enumerate(gathered):
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": rank,
                "args": {"name": f"rank {rank}: stage {stage}, column {column}"},
            }
        )
        for tid, name in ((0, "executed"), (1, "simulated (planned)")):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
        planned = [(op, a, b) for s, stream, op, a, b in simulated[column] if s == stage and stream == "compute"]
        for tid, rows in ((0, ops), (1, planned)):
            for name, start, end in rows:
                events.append(
                    {"ph": "X", "name": name, "pid": rank, "tid": tid, "ts": start * 1e3, "dur": (end - start) * 1e3}
                )
    write_json_atomic(path, {"traceEvents": events, "displayTimeUnit": "ms"})


def start_rank(args) -> tuple[torch.device, str]:
    """A DeepSpeed benchmark rank's start: its device, the process group (NCCL on GPUs, gloo on CPU),
    the precision the profile measured (``args.ranks_on`` names both for the report) and ``args.out``."""
    deepspeed_ext.skip_cpu_shm_build()
    import deepspeed

    device = use_rank_device()
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    dtype = profile_dtype(args.profile, device)
    args.ranks_on = ranks_on(device, dtype)
    os.makedirs(args.out, exist_ok=True)
    return device, dtype


def preamble(args) -> str:
    return batchings_preamble(
        f"# Training demo: {args.model}, DeepSpeed ZeRO-1, {dist.get_world_size()} {args.ranks_on}",
        args,
        "packing: rows of the maximum length, documents attending across each other (Megatron's packing; hence its "
        "slightly different loss); varlen packing: the same rows with per-document attention.",
    )


def main() -> None:
    p = common_parser(
        __doc__,
        "out/train",
        "profile JSON of the model on this machine (dynplugin profile); "
        "without it the analytic cost model prices the plans",
    )
    add_model_argument(p)
    p.add_argument("--modes", help="default: every batching but --sp's (with --stages > 1: and dyn_plugin_1f1b)")
    p.add_argument(
        "--stages",
        type=int,
        default=1,
        help="pipeline stages (the ranks are split into them): dyn_plugin plans its schedules, zero-bubble "
        "splits included, and dyn_plugin_1f1b runs the same micro-batches under 1F1B",
    )
    add_background_load_argument(p)
    p.add_argument("--memory-mb", type=float, help="device memory the plans may fill (default: the GPU's, 8000 on CPU)")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # from the deepspeed launcher
    args = p.parse_args()
    if args.modes is None:
        args.modes = ",".join(
            m
            for m in MODES
            if m not in SP_MODES
            and (args.stages > 1 or m not in PIPELINE_MODES)
            and (args.background_load > 0 or m not in CALIBRATION_MODES)
        )
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    device, dtype = start_rank(args)
    if args.memory_mb is None and any(m in SP_MODES for m in args.modes.split(",")):
        if not args.profile:
            raise SystemExit(
                "the sequence-parallel modes need --profile (measured up to --max-len tokens, recompute "
                "none and full) to cap the device memory where the longest sequences need full recompute"
            )
        args.memory_mb = split_memory_mb(args.profile, args.max_len, dist.get_world_size())
    docs, lengths = tokenized_corpus(args.lengths, args.max_len, args.out)
    records = []
    for mode in args.modes.split(","):
        records += run_mode(mode, args, docs, lengths, device, dtype)
        release_device_memory(device, mode)
    if dist.get_rank() == 0:
        finish_batchings(
            records,
            MODES,
            BASELINES,
            args.out,
            preamble(args),
            f", one executed step beside its simulation: {args.out}/pipeline-trace-dyn_plugin.json"
            if args.stages > 1
            else f", one executed step measured vs predicted: {args.out}/step-trace.json",
            budget=args.global_tokens,
        )
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # DeepSpeed sometimes aborts in its exit handlers on CPU


if __name__ == "__main__":
    main()
