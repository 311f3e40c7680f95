"""``dynplugin bench train``: the batchings trained side by side; ``--host`` and ``--model`` pick the
module that trains them (train_deepspeed.py, train_megatron.py, train_megatron_lm.py, train_hf.py,
train_pairs.py).

This module holds the sub-command's flags and the choice of module. Each module runs in child
processes (its ranks launched by module name, launch.py; Megatron-LM's pretrain_gpt.py by
train_megatron_lm.py), so this one imports no framework, and the CLI never imports train_megatron
(the one module of dyn_plugin that imports megatron_patches)."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator

from ..cli_args import STEPS, TOKENS, count, input_file, output_dir
from .launch import launch_comparison

HELP = (
    "tiny Llama with DeepSpeed on 2 CPU ranks: padded, token budget, fixed-length "
    "and varlen packing, and the plugin side by side (effective tokens/s, "
    "predicted vs measured); with --host megatron, megatron-core's GPT in the "
    "same shape: padded, packing and the plugin"
)
SP_ONLY_DEEPSPEED = "--sp compares sequence-parallel plans with --host deepspeed only; drop --sp or --host"


def default_megatron_lm() -> str | None:
    """The shared third-party Megatron-LM beside the repository (a source checkout's ../shared), if present."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(os.path.dirname(repo), "shared", "third_party", "megatron-lm")
    return path if os.path.isdir(path) else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        choices=("llama", "t5"),
        default="llama",
        help="llama (tiny Llama, the batchings above) or t5: a tiny T5 on (input, target) pairs of the bundled "
        "'tasks' distribution under DeepSpeed, the pair planner against padded pairs and token budgets "
        "(dyn_plugin/bench/train_pairs.py; needs --profile from `dynplugin profile --model tiny-t5 --ranks 2 "
        "--threads 1`)",
    )
    parser.add_argument(
        "--host",
        choices=("deepspeed", "megatron", "megatron-lm", "hf-trainer"),
        default="deepspeed",
        help="training framework: deepspeed (dyn_plugin/bench/train_deepspeed.py), megatron "
        "(dyn_plugin/bench/train_megatron.py, Megatron's schedules under the plugin's patches), megatron-lm "
        "(dyn_plugin/bench/train_megatron_lm.py, Megatron-LM's own pretrain_gpt.py: padded, Megatron-LM's "
        "packing alone, the plugin) or hf-trainer (dyn_plugin/bench/train_hf.py, the Hugging Face Trainer under "
        "DeepSpeed: the stock Trainer padded, TRL's packing, the plugin through the Trainer and in its own loop)",
    )
    parser.add_argument(
        "--megatron-lm",
        metavar="PATH",
        default=os.environ.get("MEGATRON_LM") or default_megatron_lm(),
        help="with --host megatron-lm: the Megatron-LM checkout whose pretrain_gpt.py trains "
        "(default $MEGATRON_LM, else ../shared/third_party/megatron-lm beside the repository if present)",
    )
    parser.add_argument(
        "--profile",
        type=input_file,
        help="tiny-llama profile of this machine (dynplugin profile); without it the "
        "analytic cost model prices the plans, and every row says so",
    )
    parser.add_argument(
        "--modes",
        help="comma-separated subset of the host's batchings, in the order to run (default: all of them; with "
        "--sp the sequence-parallel ones); an unknown name is refused with the host's list",
    )
    parser.add_argument("--out", type=output_dir, default="out/bench-train")
    parser.add_argument("--steps", type=STEPS, default=4)
    parser.add_argument("--ranks", type=count(1, 1024), default=2)
    parser.add_argument(
        "--max-len",
        type=TOKENS,
        help="sequences are truncated to this many tokens (default 4096; 16384 with --sp; --model t5: 512 a side)",
    )
    parser.add_argument(
        "--global-tokens", type=TOKENS, help="tokens per global batch (default 16384; --model t5: 8192, both sides)"
    )
    parser.add_argument(
        "--stages",
        type=count(1, 64),
        default=1,
        help="pipeline stages, DeepSpeed's pipeline engine (the ranks split into them): dyn_plugin plans its own "
        "schedules, zero-bubble splits of the backward included, and dyn_plugin_1f1b runs the same micro-batches "
        "under 1F1B",
    )
    parser.add_argument(
        "--background-load",
        type=count(0, 256),
        default=0,
        help="N busy processes started beside the training (not the profile, taken before on a quiet machine), "
        "for as long as it runs: the plugin's online calibration (dyn_plugin) against planning from the profile "
        "alone (dyn_plugin_static, added to the modes); --host deepspeed (also --stages, --model t5) or megatron-lm",
    )
    parser.add_argument(
        "--sp",
        action="store_true",
        help="instead, dynamic sequence parallelism against a fixed size "
        "of 2 and against full recompute, sequences up to 16384 "
        "tokens, device memory capped so the longest need one of them",
    )


def run(args: argparse.Namespace) -> Iterable[dict]:
    """Train the host's batchings side by side on local ranks; without ``--json`` the ranks print the
    table and where the report is, with it the records are the summary rows (launch.py)."""
    if args.background_load and (args.host not in ("deepspeed", "megatron-lm") or args.sp):
        raise ValueError(
            "--background-load compares the online calibration under load for --host deepspeed (data parallel, "
            "--stages, --model t5) and --host megatron-lm; with another host or --sp, drop --background-load"
        )
    if args.model == "t5":
        return _pairs(args)
    args.global_tokens = args.global_tokens or 16384
    if args.host == "megatron-lm":
        return _megatron_lm(args)
    if args.stages > 1 and (args.host != "deepspeed" or args.sp):
        raise ValueError("--stages runs DeepSpeed's pipeline engine: drop --host and --sp, or --stages")
    if args.host == "hf-trainer":
        if args.sp:
            raise ValueError(SP_ONLY_DEEPSPEED)
        from .train_hf import MODES as HF_MODES

        return launch_comparison(
            "dyn_plugin.bench.train_hf",
            "train-hf",
            args,
            ["--max-len", str(args.max_len or 4096), "--global-tokens", str(args.global_tokens)]
            + _modes(args, HF_MODES),
        )
    if args.host == "megatron":
        if args.sp:
            raise ValueError(SP_ONLY_DEEPSPEED)
        return launch_comparison(
            "dyn_plugin.bench.train_megatron",
            "train-megatron",
            args,
            ["--max-len", str(args.max_len or 4096), "--global-tokens", str(args.global_tokens)] + _modes(args),
        )
    from .train_deepspeed import MODES, SP_MODES

    extra = _modes(args, MODES) or (["--modes", ",".join(SP_MODES)] if args.sp else [])
    max_len = args.max_len or (16384 if args.sp else 4096)
    extra += ["--background-load", str(args.background_load)]
    with background_load(args.background_load):
        rows = launch_comparison(
            "dyn_plugin.bench.train_deepspeed",
            "train",
            args,
            ["--max-len", str(max_len), "--global-tokens", str(args.global_tokens), "--stages", str(args.stages)]
            + extra,
        )
    return [{**row, "background_load": args.background_load} for row in rows]


@contextlib.contextmanager
def background_load(processes: int) -> Iterator[None]:
    """``processes`` busy processes (a Python loop each) for as long as the block runs: a machine
    that changed under the profile, reproducibly."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _pairs(args: argparse.Namespace) -> list[dict]:
    """The tiny T5's batchings side by side under DeepSpeed on local ranks (torchrun), priced by its
    CPU profile."""
    if args.host != "deepspeed" or args.sp:
        raise ValueError("--model t5 trains under DeepSpeed, data parallel: drop --host and --sp")
    if not args.profile:
        raise ValueError(
            "--model t5 needs --profile: the tiny T5 measured on this machine "
            "(dynplugin profile --model tiny-t5 --ranks 2 --threads 1 --out t5-profile.json); no analytic "
            "model prices an encoder-decoder"
        )
    from .train_pairs import trainable_modes

    modes = _modes(args, trainable_modes())
    with background_load(args.background_load):
        rows = launch_comparison(
            "dyn_plugin.bench.train_pairs",
            "train-t5",
            args,
            ["--max-len", str(args.max_len or 512), "--global-tokens", str(args.global_tokens or 8192)]
            + ["--background-load", str(args.background_load)]
            + modes,
        )
    return [{**row, "background_load": args.background_load} for row in rows]


def _modes(args: argparse.Namespace, known: Iterable[str] | None = None) -> list[str]:
    """``--modes`` for the host's module, checked here against ``known`` where this process may import
    the host's list (megatron's module checks its own: importing it would apply Megatron's patches)."""
    if not args.modes:
        return []
    if known is not None:
        known = list(known)
        unknown = [m for m in args.modes.split(",") if m not in known]
        if unknown:
            raise ValueError(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    return ["--modes", args.modes]


def _megatron_lm(args: argparse.Namespace) -> list[dict]:
    """Megatron-LM's pretrain_gpt.py side by side (padded, alone, the plugin), each run in child processes
    (this process imports megatron-core only to write the corpus, megatron_patches never); with ``--json``
    its summary rows (without, it prints the table itself)."""
    if args.sp:
        raise ValueError(SP_ONLY_DEEPSPEED)
    from .train_common import cost_model_label
    from .train_megatron_lm import bench_train_megatron_lm

    run_args = argparse.Namespace(**vars(args), lengths="code", warmup=1, memory_mb=8000.0)
    run_args.max_len = args.max_len or 4096
    with background_load(args.background_load):
        rows = bench_train_megatron_lm(run_args)
    label = cost_model_label(args.profile)
    extra = {"cost_model": label, "background_load": args.background_load}
    return [{"benchmark": "train-megatron-lm", **extra, **row} for row in rows] if args.json else []
