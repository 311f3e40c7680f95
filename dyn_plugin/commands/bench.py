"""``dynplugin bench WHAT``: benchmarks that print JSON (figures go into BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Iterable

from ..bench.families import FAMILIES
from ..bench.shard import SETUPS
from ..checks import MAX_RANKS, MAX_TOKENS
from ..cost.calibrated import MODELS
from ..lengths.corpus import DISTRIBUTIONS
from .args import (
    SEED,
    STEPS,
    TOKENS,
    choices,
    count,
    counts,
    fraction,
    grids,
    input_file,
    number,
    numbers,
    output_dir,
    powers_of_two,
    redis_url,
)

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


DISTS = choices(tuple(DISTRIBUTIONS))
# bench planner's models and their default global tokens and pp x dp grids
PLANNER_DEFAULTS = {"gpt-6.7b": ("16384,65536,262144", "1x1,4x2,8x8"), "t5-11b": ("65536", "4x2")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", required=True, metavar="WHAT")
    cost = sub.add_parser("cost", help="cost-model queries per second, C++ evaluator vs the Python twin")
    cost.add_argument("--queries", type=STEPS, default=20000, help="micro-batches to price (default %(default)s)")
    cost.add_argument("--seed", type=SEED, default=0)
    planner = sub.add_parser(
        "planner",
        help="planning time and simulated step time against the baselines, "
        "A100 GPT-6.7B costs, bundled length distributions (--model t5-11b: A100 T5 11B costs, the bundled "
        "pair distribution 'tasks', the pair baselines)",
    )
    planner.add_argument(
        "--model",
        choices=PLANNER_DEFAULTS,
        default="gpt-6.7b",
        help="gpt-6.7b (dyn_plugin/bench/planner.py) or t5-11b: (input, target) pairs on encoder then decoder "
        "stages (dyn_plugin/bench/planner_pairs.py; --distributions, --python-batches and --no-pyramid do not apply)",
    )
    planner.add_argument("--distributions", type=DISTS, default="code,prose,mixture")
    planner.add_argument(
        "--global-tokens",
        type=counts(1, MAX_TOKENS),
        help="default 16384,65536,262144 (gpt-6.7b), 65536 (t5-11b: input and target tokens)",
    )
    planner.add_argument(
        "--parallel", type=grids, help="pp x dp configurations; default 1x1,4x2,8x8 (gpt-6.7b), 4x2 (t5-11b)"
    )
    planner.add_argument("--batches", type=STEPS, default=10, help="global batches per configuration")
    planner.add_argument(
        "--python-batches",
        type=count(0),
        default=2,
        help="of those, how many also go through the (slow) pure-Python planner",
    )
    planner.add_argument("--seed", type=SEED, default=0)
    planner.add_argument(
        "--no-pyramid",
        action="store_true",
        help="plan without pyramid checkpointing (every micro-batch recomputes all of its layers or "
        "none); by default the all-or-nothing plans are also run as dynapipe_all_or_nothing",
    )
    sp = sub.add_parser(
        "sp",
        help="dynamic sequence parallelism vs fixed sizes, Megatron's hybrid CP and DCP's "
        "buckets: simulated step on A100 GPT-6.7B costs with priced attention collectives",
    )
    sp.add_argument("--distributions", type=DISTS, default="code,prose,mixture")
    sp.add_argument("--global-tokens", type=counts(1, MAX_TOKENS), default="65536,262144")
    sp.add_argument("--gpus", type=counts(1, MAX_RANKS), default="8,32")
    sp.add_argument(
        "--pp", type=counts(1, MAX_RANKS), default="4,1", help="pipeline stages, comma-separated (columns = gpus / pp)"
    )
    sp.add_argument(
        "--max-len", type=counts(1, MAX_TOKENS), default="8192,32768", help="sequences are capped at each of these"
    )
    sp.add_argument(
        "--sizes",
        type=powers_of_two(),
        default="1,2,4,8,16,32",
        help="sequence-parallel group sizes allowed (those up to the column count apply)",
    )
    sp.add_argument("--batches", type=STEPS, default=4, help="global batches per configuration")
    sp.add_argument("--seed", type=SEED, default=0)
    shard = sub.add_parser(
        "shard",
        help="the sharding search (osdp) against full_shard, shard_grad_op and no_shard: "
        "search time, simulated step and peak memory on A100 costs",
    )
    shard.add_argument(
        "--models",
        type=choices(tuple(SETUPS)),
        default="gpt-6.7b,gpt-48l",
        help="gpt-6.7b (A100-measured layers), gpt-48l (GPT-2 XL's shape, analytic A100 costs)",
    )
    shard.add_argument("--gpus", type=counts(1, MAX_RANKS), default="8,16", help="ranks (8 per node)")
    shard.add_argument("--budgets-mb", type=numbers(), default="24000,30000,36000", help="memory budgets per rank")
    shard.add_argument("--tokens-per-gpu", type=TOKENS, default=16384, help="global batch = this x gpus tokens")
    shard.add_argument("--max-len", type=TOKENS, help="sequences are capped at this (default 8192; 4096 with --train)")
    shard.add_argument("--lengths", default="code")
    shard.add_argument("--seed", type=SEED, default=0)
    shard.add_argument(
        "--train",
        action="store_true",
        help="instead, train tiny Llama with FSDP2 on local CPU ranks (a GPU each where there are GPUs) "
        "under --budget-mb, every method's plan side by side: measured effective tokens/s and peak "
        "memory (dyn_plugin/bench/train_fsdp.py)",
    )
    shard.add_argument(
        "--budget-mb",
        type=number(),
        help="with --train: memory per rank (model states + activations) "
        "the plans are searched for and trained under (default: the "
        "largest whole MB at which no_shard does not fit)",
    )
    shard.add_argument(
        "--profile",
        type=input_file,
        help="with --train: tiny-llama profile of this machine (dynplugin profile --ranks 2); "
        "without it the analytic cost model prices the plans",
    )
    shard.add_argument("--out", type=output_dir, default="out/bench-shard-train", help="with --train: report folder")
    shard.add_argument("--steps", type=STEPS, default=4, help="with --train: timed steps per method")
    shard.add_argument("--ranks", type=count(1, 1024), default=2, help="with --train: local ranks")
    shard.add_argument("--global-tokens", type=TOKENS, default=16384, help="with --train: tokens per global batch")
    shard.add_argument("--overlap", type=number(), help="with --train: sharding.overlap (default: the config's)")
    strategy = sub.add_parser(
        "strategy",
        help="heterogeneous strategies (hydraulis) against the seed's stage 1, the best "
        "homogeneous strategy and dynapipe: planning time per step and "
        "simulated step on A100 costs",
    )
    strategy.add_argument("--distributions", type=DISTS, default="code,prose,mixture")
    strategy.add_argument(
        "--models",
        type=choices(tuple(MODELS)),
        default="gpt-6.7b",
        help="gpt-6.7b (measured A100 tables), llama-7b, llama-13b, llama-32b (calibrated on them)",
    )
    strategy.add_argument("--gpus", type=counts(1, MAX_RANKS), default="64,1024")
    strategy.add_argument("--tokens-per-gpu", type=TOKENS, default=4096, help="global batch = this x gpus tokens")
    strategy.add_argument("--max-len", type=TOKENS, default=32768, help="sequences are capped at this")
    strategy.add_argument("--max-strategies", type=count(1, 64), default=3)
    strategy.add_argument("--batches", type=STEPS, default=8, help="global batches per configuration")
    strategy.add_argument(
        "--plot-dir", type=output_dir, help="a plot per configuration: the strategies and one step's pipeline loads"
    )
    strategy.add_argument("--seed", type=SEED, default=0)
    strategy.add_argument(
        "--memory-margin",
        type=fraction(0.5),
        default=0.08,
        help="a method whose plans exceed the device's memory by the measured tables is planned again for "
        "this fraction less (default %(default)s: the most the tables measured above the cost model's "
        "estimate on this benchmark, 6.5%%; 0: no second try)",
    )
    loader = sub.add_parser(
        "loader",
        help="loader steps/s, time each step waits for its plan (planning locally or "
        "ahead through a store), store round-trip latency",
    )
    loader.add_argument("--steps", type=STEPS, default=20)
    loader.add_argument(
        "--step-ms", type=numbers(-1.0), default="0,50,200", help="simulated training step times (ms), comma-separated"
    )
    loader.add_argument("--planners", type=count(1, 64), default=2)
    loader.add_argument("--prefetch", type=count(1, 1024), default=4)
    loader.add_argument(
        "--samples",
        type=STEPS,
        help="instead, the loader's own cost on a dataset of this many samples: "
        "start-up and per-step overhead, planning and collation left out",
    )
    loader.add_argument(
        "--redis-url",
        type=redis_url,
        help="measure this Redis server (password in $DYN_PLUGIN_REDIS_PASSWORD) rather "
        "than a throwaway local redis-server",
    )
    train = sub.add_parser(
        "train",
        help="tiny Llama with DeepSpeed on 2 CPU ranks: padded, token budget, fixed-length "
        "and varlen packing, and the plugin side by side (effective tokens/s, "
        "predicted vs measured); with --host megatron, megatron-core's GPT in the "
        "same shape: padded, packing and the plugin",
    )
    train.add_argument(
        "--model",
        choices=("llama", "t5"),
        default="llama",
        help="llama (tiny Llama, the batchings above) or t5: a tiny T5 on (input, target) pairs of the bundled "
        "'tasks' distribution under DeepSpeed, the pair planner against padded pairs and token budgets "
        "(dyn_plugin/bench/train_pairs.py; needs --profile from `dynplugin profile --model tiny-t5 --ranks 2 "
        "--threads 1`)",
    )
    train.add_argument(
        "--host",
        choices=("deepspeed", "megatron", "megatron-lm"),
        default="deepspeed",
        help="training framework: deepspeed (dyn_plugin/bench/train_deepspeed.py), megatron "
        "(dyn_plugin/bench/train_megatron.py, Megatron's schedules under the plugin's patches) or megatron-lm "
        "(dyn_plugin/bench/train_megatron_lm.py, Megatron-LM's own pretrain_gpt.py: padded, Megatron-LM's "
        "packing alone, the plugin)",
    )
    train.add_argument(
        "--megatron-lm",
        metavar="PATH",
        default=os.environ.get("MEGATRON_LM") or default_megatron_lm(),
        help="with --host megatron-lm: the Megatron-LM checkout whose pretrain_gpt.py trains "
        "(default $MEGATRON_LM, else ../shared/third_party/megatron-lm beside the repository if present)",
    )
    train.add_argument(
        "--profile",
        type=input_file,
        help="tiny-llama profile of this machine (dynplugin profile); without it the "
        "analytic cost model prices the plans, and every row says so",
    )
    train.add_argument(
        "--modes",
        help="comma-separated subset of the host's batchings, in the order to run (default: all of them; with "
        "--sp the sequence-parallel ones); an unknown name is refused with the host's list",
    )
    train.add_argument("--out", type=output_dir, default="out/bench-train")
    train.add_argument("--steps", type=STEPS, default=4)
    train.add_argument("--ranks", type=count(1, 1024), default=2)
    train.add_argument(
        "--max-len",
        type=TOKENS,
        help="sequences are truncated to this many tokens (default 4096; 16384 with --sp; --model t5: 512 a side)",
    )
    train.add_argument(
        "--global-tokens", type=TOKENS, help="tokens per global batch (default 16384; --model t5: 8192, both sides)"
    )
    train.add_argument(
        "--sp",
        action="store_true",
        help="instead, dynamic sequence parallelism against a fixed size "
        "of 2 and against full recompute, sequences up to 16384 "
        "tokens, device memory capped so the longest need one of them",
    )
    from ..bench.checkpoint import add_arguments as checkpoint_arguments

    checkpoint = checkpoint_arguments(sub, size=number(0.0), count=count(1, 4096))
    from ..bench.start_check import add_arguments as start_check_arguments

    start_check = start_check_arguments(sub, count=count(1, 100))
    families = sub.add_parser(
        "families",
        help="the cost model held out on each family's tiny model (Llama, Mistral, Qwen2, Qwen2-MoE, Mixtral, Phi3, "
        "Gemma2, Gemma3, GPT-NeoX, GPT-2, OLMo2): one packed micro-batch predicted from a profile of this "
        "machine through the family's shape, against its measured step (dyn_plugin/bench/families.py)",
    )
    families.add_argument(
        "--profile",
        type=input_file,
        required=True,
        help="a tiny-llama profile of this machine (dynplugin profile; CPU)",
    )
    families.add_argument("--families", type=choices(tuple(FAMILIES)), help="comma-separated subset (default: all)")
    families.add_argument(
        "--seq-len", type=TOKENS, default=512, help="the micro-batch's longest document (default %(default)s)"
    )
    families.add_argument(
        "--micro-batch-size",
        type=count(1, 2**16),
        default=2,
        help="the micro-batch holds this many times --seq-len tokens, the rest cut into documents at random "
        "(default %(default)s: 1024 tokens, the largest a default profile measures)",
    )
    families.add_argument("--warmup", type=count(0), default=1)
    families.add_argument("--repeats", type=STEPS, default=10, help="timed rounds; the minimum is kept")
    families.add_argument("--seed", type=SEED, default=0)
    for p in (cost, planner, sp, shard, strategy, loader, train, families, checkpoint, start_check):
        p.add_argument("--json", action="store_true", help="one JSON object per line, no indentation")


def run(args: argparse.Namespace) -> int:
    host = dict(machine=platform.machine(), python=platform.python_version(), date=time.strftime("%Y-%m-%d"))
    if args.what == "train":
        return bench_train(args, host)
    if args.what == "shard" and args.train:
        return bench_shard_train(args, host)
    if args.what in ("planner", "sp", "shard", "strategy", "loader", "families"):
        if args.what == "families":
            from ..bench.families import bench_families

            records = bench_families(args)
        elif args.what == "planner":
            tokens, grid = PLANNER_DEFAULTS[args.model]
            args.global_tokens = counts(1, MAX_TOKENS)(tokens) if args.global_tokens is None else args.global_tokens
            args.parallel = grids(grid) if args.parallel is None else args.parallel
            if args.model == "t5-11b":
                from ..bench.planner_pairs import bench_planner_pairs

                records = bench_planner_pairs(args)
            else:
                from ..bench.planner import bench_planner

                records = bench_planner(args)
        elif args.what == "sp":
            from ..bench.sp import bench_sp

            records = bench_sp(args)
        elif args.what == "strategy":
            from ..bench.strategy import bench_strategy

            records = bench_strategy(args)
        elif args.what == "shard":
            from ..bench.shard import bench_shard
            from ..models.shard_units import config_units

            args.max_len = args.max_len or 8192
            records = bench_shard(
                args,
                {"gpt-6.7b": config_units(example_config("gpt-6.7b.json"))[1], "gpt-48l": config_units(GPT_48L)[1]},
            )
        elif args.samples is not None:
            from ..bench.loader import bench_loader_scale

            records = [bench_loader_scale(args.samples, steps=args.steps)]
        else:
            from ..bench.loader import bench_loader

            records = bench_loader(
                steps=args.steps,
                step_ms=args.step_ms,
                planners=args.planners,
                prefetch=args.prefetch,
                redis_url=args.redis_url,
            )
        for record in records:
            print(json.dumps({**record, **host}, indent=None if args.json else 2), flush=True)
        return 0
    if args.what == "checkpoint":
        from ..bench.checkpoint import bench_checkpoint

        record = bench_checkpoint(args)
    elif args.what == "start-check":
        from ..bench.start_check import bench_start_check

        record = bench_start_check(args)
    else:
        record = {"cost": bench_cost}[args.what](args)
    record.update(host)
    print(json.dumps(record, indent=None if args.json else 2))
    return 0


# GPT-2 XL's shape with Megatron's padded vocabulary and an untied head (the head can then be split)
GPT_48L = dict(
    model_type="gpt2",
    n_embd=1600,
    n_layer=48,
    n_head=25,
    n_inner=6400,
    vocab_size=50304,
    n_positions=8192,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
)


def bench_cost(args: argparse.Namespace) -> dict:
    """Price random micro-batches of the GPT-6.7B-class analytic model on one 8-layer stage."""
    import numpy as np

    from ..config import DeviceSpec, ModelShape
    from ..cost.analytic import analytic_cost_model
    from ..cost.model import StageSpec, features
    from ..cost.table import evaluate_stage

    shape = ModelShape(
        hidden_size=4096, num_layers=32, num_heads=32, ffn_hidden_size=16384, vocab_size=50257, gated_mlp=False
    )
    model = analytic_cost_model(shape, DeviceSpec(name="a100", memory_mb=40000, peak_tflops=312))
    rng = np.random.default_rng(args.seed)
    sizes = rng.integers(1, 17, size=args.queries)
    lens = rng.integers(16, 4096, size=int(sizes.sum()))
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    batches = [lens[offsets[i] : offsets[i + 1]].tolist() for i in range(args.queries)]
    stage = StageSpec(8, first=False, last=False)
    table = model.table("packed", "none")
    out = {"benchmark": "cost", "queries": args.queries, "mean_sequences_per_query": float(sizes.mean())}

    t0 = time.perf_counter()
    py = [evaluate_stage(table, features(b, "packed"), stage).forward_ms for b in batches]
    out["python_us_per_query"] = (time.perf_counter() - t0) / args.queries * 1e6
    native = model.native("packed", "none")
    if native is None:
        out["native"] = "not built"
        return out
    t0 = time.perf_counter()
    many = native.stage_cost_many(lens, offsets, stage.num_layers, stage.first, stage.last)
    out["native_batched_us_per_query"] = (time.perf_counter() - t0) / args.queries * 1e6
    arrays = [np.asarray(b, dtype=np.int64) for b in batches]
    t0 = time.perf_counter()
    for a in arrays:
        native.stage_cost(a, stage.num_layers, stage.first, stage.last)
    out["native_single_call_us_per_query"] = (time.perf_counter() - t0) / args.queries * 1e6
    out["max_rel_diff_native_vs_python"] = float(np.max(np.abs(many[:, 0] - py) / np.array(py)))
    out["speedup_batched_vs_python"] = out["python_us_per_query"] / out["native_batched_us_per_query"]
    return out


def bench_train(args: argparse.Namespace, host: dict) -> int:
    """Launch DeepSpeed's (or, with ``--host megatron``, Megatron's) batchings side by side on local ranks
    (torchrun), then print its summary rows. Each runs by module name in the ranks' processes: this
    process never imports train_megatron (the one module of dyn_plugin that imports megatron_patches)."""
    if args.model == "t5":
        return bench_train_pairs(args, host)
    args.global_tokens = args.global_tokens or 16384
    if args.host == "megatron-lm":
        return bench_train_megatron_lm(args, host)
    if args.host == "megatron":
        if args.sp:
            raise ValueError("--sp compares sequence-parallel plans with --host deepspeed only; drop --sp or --host")
        return launch_comparison(
            "dyn_plugin.bench.train_megatron",
            "train-megatron",
            args,
            host,
            ["--max-len", str(args.max_len or 4096), "--global-tokens", str(args.global_tokens)] + _modes(args),
        )
    from ..bench.train_deepspeed import MODES, SP_MODES

    extra = _modes(args, MODES) or (["--modes", ",".join(SP_MODES)] if args.sp else [])
    max_len = args.max_len or (16384 if args.sp else 4096)
    return launch_comparison(
        "dyn_plugin.bench.train_deepspeed",
        "train",
        args,
        host,
        ["--max-len", str(max_len), "--global-tokens", str(args.global_tokens)] + extra,
    )


def bench_train_pairs(args: argparse.Namespace, host: dict) -> int:
    """The tiny T5's batchings side by side under DeepSpeed on local ranks (torchrun), priced by its
    CPU profile; its summary rows."""
    if args.host != "deepspeed" or args.sp:
        raise ValueError("--model t5 trains under DeepSpeed, data parallel: drop --host and --sp")
    if not args.profile:
        raise ValueError(
            "--model t5 needs --profile: the tiny T5 measured on this machine "
            "(dynplugin profile --model tiny-t5 --ranks 2 --threads 1 --out t5-profile.json); no analytic "
            "model prices an encoder-decoder"
        )
    from ..bench.train_pairs import trainable_modes

    modes = _modes(args, trainable_modes())
    return launch_comparison(
        "dyn_plugin.bench.train_pairs",
        "train-t5",
        args,
        host,
        ["--max-len", str(args.max_len or 512), "--global-tokens", str(args.global_tokens or 8192)] + modes,
    )


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


def example_config(name: str) -> str:
    """A model config in the checkout's examples/, found from this file (not the working directory);
    a refusal where the package was installed without them."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(repo, "examples", name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: bench shard needs a source checkout of dyn-plugin (its examples/)")
    return path


def default_megatron_lm() -> str | None:
    """The shared third-party Megatron-LM beside the repository (a source checkout's ../shared), if present."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(os.path.dirname(repo), "shared", "third_party", "megatron-lm")
    return path if os.path.isdir(path) else None


def bench_train_megatron_lm(args: argparse.Namespace, host: dict) -> int:
    """Megatron-LM's pretrain_gpt.py side by side (padded, alone, the plugin), each run in child processes
    (this process imports megatron-core only to write the corpus, megatron_patches never); its summary rows."""
    if args.sp:
        raise ValueError("--sp compares sequence-parallel plans with --host deepspeed only; drop --sp or --host")
    from ..bench.train_common import cost_model_label
    from ..bench.train_megatron_lm import bench_train_megatron_lm as run_benchmark

    run_args = argparse.Namespace(**vars(args), lengths="code", warmup=1, memory_mb=8000.0)
    run_args.max_len = args.max_len or 4096
    for row in run_benchmark(run_args):
        record = {"benchmark": "train-megatron-lm", "cost_model": cost_model_label(args.profile), **row, **host}
        print(json.dumps(record, indent=None if args.json else 2), flush=True)
    return 0


def bench_shard_train(args: argparse.Namespace, host: dict) -> int:
    """Launch the sharding plans side by side on local ranks (torchrun), then print its summary rows."""
    extra = [
        "--max-len",
        str(args.max_len or 4096),
        "--global-tokens",
        str(args.global_tokens),
        "--lengths",
        args.lengths,
        "--seed",
        str(args.seed),
    ]
    for flag, value in (("--budget-mb", args.budget_mb), ("--overlap", args.overlap)):
        extra += [flag, str(value)] if value is not None else []
    return launch_comparison("dyn_plugin.bench.train_fsdp", "shard-train", args, host, extra)


def launch_comparison(module: str, benchmark: str, args: argparse.Namespace, host: dict, extra: list[str]) -> int:
    """Run ``module`` on ``args.ranks`` local ranks (torchrun) writing into ``args.out``, then print
    each row of its summary.json as a JSON record."""
    import os
    import subprocess
    import sys

    from ..bench.train_common import cost_model_label

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
            )
        )
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL if args.json else None)
    if done.returncode != 0:
        raise RuntimeError(f"{benchmark} comparison failed (exit {done.returncode}): {' '.join(cmd)}")
    with open(os.path.join(args.out, "summary.json")) as f:
        for row in json.load(f):
            print(
                json.dumps(
                    {"benchmark": benchmark, "cost_model": cost_model, **row, **host}, indent=None if args.json else 2
                )
            )
    return 0
