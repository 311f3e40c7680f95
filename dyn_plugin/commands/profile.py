"""``dynplugin profile``: measure a model on this device and write a fitted cost profile."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from ..cli_args import TOKENS, count, counts, output_file

if TYPE_CHECKING:  # imported where used: the CLI starts without torch
    from ..profiling.device import Target
    from ..profiling.profiler import ProfileRun
    from ..profiling.workload import ProfileGrid

HELP = (
    "measure a transformers model (tiny by default, no download) and write a fitted profile JSON; "
    "`profile import FILE` converts per-layer tables measured elsewhere (e.g. the A100 tables)"
)

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        nargs="?",
        choices=("measure", "import"),
        default="measure",
        help="measure (default) a model here, or import FILE",
    )
    parser.add_argument("source", nargs="?", help="with import: per-layer cost tables JSON (a100-measured format)")
    parser.add_argument("--num-layers", type=count(), help="with import: layers of the model the tables describe")
    parser.add_argument("--hidden-size", type=count(), help="with import: the model's hidden size")
    parser.add_argument(
        "--num-heads",
        type=count(),
        help="with import: the model's attention heads (known for the A100 tables gpt-6.7b and t5-11b)",
    )
    parser.add_argument("--num-kv-heads", type=count(), help="with import: key/value heads, if fewer than --num-heads")
    parser.add_argument(
        "--vocab-size", type=count(), help="with import: the vocabulary, which sizes the loss's memory on the head"
    )
    parser.add_argument(
        "--model",
        default="tiny-llama",
        help="preset (tiny-llama, llama-350m, tiny-gpt2) or path to a HF config.json (default: tiny-llama)",
    )
    parser.add_argument("--out", required=True, type=output_file, help="profile JSON to write")
    parser.add_argument(
        "--device", help="torch device to measure on: cuda (the default where there is one), cuda:N or cpu"
    )
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        help="training precision to measure in (default: bf16 on CUDA, fp32 on CPU); the "
        "DeepSpeed config's precision and cost_model.dtype must match it",
    )
    parser.add_argument("--seq-lens", type=counts(1, 2**20), help="sequence lengths to measure, e.g. 16,64,256,1024")
    parser.add_argument("--micro-batch-sizes", type=counts(1, 2**16), help="micro-batch sizes to measure, e.g. 1,4,16")
    parser.add_argument("--max-tokens", type=TOKENS, help="skip grid points with more tokens than this")
    parser.add_argument(
        "--recompute",
        default="none,selective,full",
        help="recompute modes to measure (comma-separated; default all three)",
    )
    parser.add_argument("--repeats", type=count(), help="timed repeats per point (the minimum is kept)")
    parser.add_argument(
        "--ranks",
        type=count(1, 1024),
        default=1,
        help="measure as one of N training ranks on this host: on CPU N-1 processes train beside "
        "it; the gradient all-reduce, sharded data parallelism's all-gather and "
        "reduce-scatter and sequence parallelism's all-to-all and ring exchange are measured "
        "among N (on CUDA over NCCL, one GPU each: with fewer GPUs they are "
        "priced from the cluster link). Use the ranks per host you train with",
    )
    parser.add_argument(
        "--threads", type=count(1, 4096), help="torch intra-op threads (training ranks often run with 1)"
    )
    parser.add_argument(
        "--validate",
        type=count(0),
        default=16,
        metavar="N",
        help="also time N held-out random micro-batches through the full model and report "
        "the fit's error on them (default 16; 0 to skip)",
    )
    parser.add_argument(
        "--system-allocator",
        action="store_true",
        help="leave glibc malloc's dynamic mmap/trim thresholds alone (the default pins them, "
        "which makes CPU step times predictable; see dyn_plugin/profiling/allocator.py)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    if args.action == "import":
        return run_import(args)
    if args.source:
        raise ValueError(f"unexpected argument {args.source!r}; did you mean `dynplugin profile import {args.source}`?")
    from ..cost.profile import save_profile
    from ..models.hf import hf_config, load_model_config
    from ..profiling.device import resolve_target
    from ..profiling.profiler import run_profile
    from ..profiling.workload import ProfileGrid

    model_cfg = load_model_config(args.model)
    if hf_config(model_cfg).is_encoder_decoder:
        return run_pairs(args, model_cfg)
    grid = _grid(args, ProfileGrid())
    if not grid.points():
        raise ValueError("the grid is empty: every (seq_len x micro_batch_size) exceeds --max-tokens")
    profile = run_profile(model_cfg, _run(args, model_cfg, grid, resolve_target(args.device, args.dtype)))
    save_profile(profile, args.out)
    print_summary(profile)
    print(f"profile written to {args.out}")
    return 0


def _run(args: argparse.Namespace, model_cfg: dict, grid: ProfileGrid, target: Target | None) -> ProfileRun:
    """How the flags ask the profile to be measured, for any model."""
    from ..profiling.profiler import ProfileRun

    name = args.model if isinstance(args.model, str) and "/" not in args.model else model_cfg["model_type"]
    return ProfileRun(
        name=name,
        grid=grid,
        validate=args.validate,
        threads=args.threads,
        fixed_allocator=not args.system_allocator,
        progress=not args.no_progress,
        ranks=args.ranks,
        target=target,
    )


def _grid(args: argparse.Namespace, default):
    """The profile grid: ``default`` with the flags given on top (recompute modes checked by name)."""
    from dataclasses import replace

    from ..cost.model import RECOMPUTES

    recomputes = tuple(args.recompute.split(","))
    bad = [r for r in recomputes if r not in RECOMPUTES]
    if bad:
        raise ValueError(f"--recompute {','.join(bad)}: allowed modes are {', '.join(RECOMPUTES)}")
    overrides = {
        "seq_lens": args.seq_lens,
        "micro_batch_sizes": args.micro_batch_sizes,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
    }
    return replace(default, recomputes=recomputes, **{k: v for k, v in overrides.items() if v is not None})


# An encoder-decoder's default grid: both sides over these lengths (up to 1024 tokens a side, the
# bench's pairs cut to 512 a side), a few minutes on 2 CPU cores
PAIR_SEQ_LENS = (16, 64, 256, 512)


def run_pairs(args: argparse.Namespace, model_cfg: dict) -> int:
    """An encoder-decoder (``--model tiny-t5``): per-layer tables in the A100 T5 tables' format
    (``dyn_plugin.profiling.pairs``), read by ``cost.encoder_decoder.import_t5_tables``."""
    from ..atomic import write_json_atomic
    from ..profiling.pairs import run_pair_profile
    from ..profiling.workload import ProfileGrid

    if (args.device or "cpu") != "cpu" or (args.dtype or "fp32") != "fp32":
        raise ValueError(
            f"--model {args.model}: an encoder-decoder is profiled on CPU in fp32 only (got --device "
            f"{args.device or 'cpu'} --dtype {args.dtype or 'fp32'}); drop --device and --dtype"
        )
    if args.system_allocator:
        raise ValueError("--system-allocator: an encoder-decoder is profiled under the pinned allocator only")
    grid = _grid(args, ProfileGrid(seq_lens=PAIR_SEQ_LENS, layouts=("padded",)))
    if not grid.pair_points():
        raise ValueError("the grid is empty: every (seq_len x micro_batch_size) exceeds --max-tokens")
    raw = run_pair_profile(model_cfg, _run(args, model_cfg, grid, None))
    write_json_atomic(args.out, raw)
    v = raw.get("validation")
    print(f"{len(grid.pair_points())} (input, target, pairs) points x {len(grid.recomputes)} recompute modes")
    if v:
        print(
            f"held-out: {v['count']} random micro-batches of pairs through the {v['encoder_layers']}+"
            f"{v['decoder_layers']}-layer model ({v['recompute']} recompute): step-time error mean "
            f"{v['mape']:.1%}, max {v['max_ape']:.1%}"
        )
    print(f"encoder-decoder tables written to {args.out} (dyn_plugin.cost.encoder_decoder.import_t5_tables reads them)")
    return 0


def print_summary(profile) -> None:
    """Fit error of each table (of the layer), the update's and the collectives' cost, and the
    held-out error if measured."""
    from ..cost.model import Precision
    from ..cost.profile import cost_model_from_profile

    cost = cost_model_from_profile(profile)
    d = profile.device
    print(f"measured on {d.type} ({d.name}) in {d.dtype}")
    print(f"{'table':<24}{'fwd MAPE':>10}{'bwd MAPE':>10}{'stored MAPE':>13}  (fit error)")
    for t in profile.tables:
        f = t.fits["layer"]
        print(
            f"{t.layout + '/' + t.recompute + '/tp' + str(t.tp):<24}{f['forward_ms'].mape:>10.1%}"
            f"{f['backward_ms'].mape:>10.1%}{f['stored_bytes'].mape:>13.1%}"
        )
    u = profile.update
    if u is not None and (u.optimizer or u.allreduce):
        params = cost.stage_params()
        line = (
            f"update of the whole model ({params / 1e6:.1f}M parameters): AdamW step "
            f"{cost.update.optimizer_ms(params):.1f} ms"
        )
        if u.allreduce:
            grad_bytes = params * Precision.of(cost.dtype).grad
            line += (
                f", {u.backend} all-reduce of its {cost.dtype} gradients among {profile.ranks}: "
                f"{cost.update.allreduce_ms(grad_bytes, profile.ranks, 1.0):.1f} ms"
            )
        print(line)
    if u is not None and u.allgather and u.reducescatter:
        layer = cost.params["layer"] * Precision.of(cost.dtype).param
        print(
            f"sharded data parallelism, {u.backend} among {profile.ranks}: all-gather of one layer's parameters "
            f"{cost.update.allgather_ms(layer, profile.ranks, 1.0):.2f} ms, reduce-scatter of its gradients "
            f"{cost.update.reducescatter_ms(layer, profile.ranks, 1.0):.2f} ms"
        )
    c = profile.collectives
    if c is not None and c.alltoall and c.p2p:
        sp, mib = cost.collectives, 1 << 20
        print(
            f"sequence parallelism, {c.backend} among {profile.ranks}: all-to-all of 1 MiB per rank "
            f"{sp.alltoall[0] + sp.alltoall[1] * mib:.2f} ms, ring exchange of 1 MiB "
            f"{sp.p2p[0] + sp.p2p[1] * mib:.2f} ms"
        )
    if profile.ranks > 1 and u is not None and not u.allreduce:
        print(
            f"all-reduce among {profile.ranks} not measured (fewer {d.type} devices than ranks), nor the "
            "sharded data-parallel and sequence-parallel collectives: priced from the cluster's link bandwidth"
        )
    v = profile.validation
    if v:
        print(
            f"held-out: {v['count']} random micro-batches through the {v['num_layers']}-layer model "
            f"({v['recompute']} recompute): step-time error mean {v['mape']:.1%}, max {v['max_ape']:.1%}"
        )
    pyr = profile.pyramid
    if pyr:
        counts = "/".join(str(c["checkpointed"]) for c in pyr["cases"])
        print(
            f"pyramid: peak memory with {counts} of {pyr['num_layers']} layers under {pyr['recompute']} recompute, "
            f"predicted within {pyr['max_error']:.1%} of measured"
        )


def run_import(args: argparse.Namespace) -> int:
    from ..cost.measured_tables import import_measured_tables
    from ..cost.profile import save_profile
    from ..jsonfile import read_json

    if args.source is None or args.num_layers is None or args.hidden_size is None:
        raise ValueError("usage: dynplugin profile import FILE --num-layers N --hidden-size H --out profile.json")
    raw = read_json(args.source, "cost tables file")
    if not isinstance(raw, dict):
        raise ValueError(f"cost tables file {args.source}: expected a JSON object with 'tables'")
    profile = import_measured_tables(
        raw,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        vocab_size=args.vocab_size,
    )
    save_profile(profile, args.out)
    print_summary(profile)
    print(f"{len(profile.samples)} samples from {args.source} -> {args.out}")
    return 0
