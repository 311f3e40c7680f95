"""Train a tiny T5 with DeepSpeed on (input, target) pairs, batchings side by side, on real code.

    torchrun --nproc_per_node=2 -m dyn_plugin.bench.train_pairs --profile out/t5-profile.json --out out/train-t5

The model is the one the profile measured (``dynplugin profile --model tiny-t5``: its tables,
named in the DeepSpeed config and read by ``cost.from_config.pair_cost_model``, price every plan); CPU ranks, gloo, fp32,
ZeRO-1. The data: the bundled pair distribution's texts (``tasks``: summaries, signatures,
explanations, ... of the standard library, man pages and pydoc topics), tokenized with the
plugin's offline BPE, each side cut to ``--max-len`` tokens.

Modes: padded (each side padded to ``--max-len``, a fixed number of pairs per micro-batch:
``microbatching.method`` fixed_padding), token_budget (pairs grouped under a token budget on
input + target, each side padded to its longest), packing (T5 packing per side: rows of whole
pairs, each side's row ``--max-len`` wide, packing_full) and dyn_plugin (the pair planner,
``plan_pairs``).
Each trains the same model from the same initial weights on the same global batches. Effective
tokens count both sides' real tokens. (``dynplugin bench train --model t5`` launches it, and
with ``--json`` prints the summary as JSON.)
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import deepspeed_ext

from ..atomic import atomic_path
from ..config import CostModelConfig
from ..cost.encoder_decoder import EncoderDecoderCostModel, read_pair_tables
from ..cost.from_config import pair_cost_model
from ..models.hf import build_seq2seq_lm, hf_config
from ..runtime.planning import PAIR_METHODS
from .train_common import (
    add_background_load_argument,
    batchings_preamble,
    common_parser,
    finish_batchings,
    ranks_on,
    step_record,
    timed_step,
    use_rank_device,
)
from .train_deepspeed import device_memory_mb

# mode -> microbatching.method; each is trained where the loader plans it for pairs (PAIR_METHODS)
MODES = {
    "padded": "fixed_padding",
    "token_budget": "token_budget",
    "packing": "packing_full",
    "dyn_plugin": "dynapipe",
    "dyn_plugin_static": "dynapipe",  # without online calibration: by default under --background-load only
}
BASELINES = ("padded", "token_budget", "packing", "dyn_plugin_static")


def trainable_modes() -> list[str]:
    """The modes the loader trains on pairs (runtime.planning.PAIR_METHODS, and the plugin's own)."""
    return [m for m, method in MODES.items() if method == "dynapipe" or method in PAIR_METHODS]


def tokenized_pairs(name: str, max_len: int, out: str) -> tuple[list[dict], np.ndarray]:
    """The pairs of distribution ``name`` as token ids, each side cut to ``max_len`` tokens (pairs
    with an empty side dropped: nothing to encode or to predict), and their [N, 2] lengths; rank 0
    tokenizes once into ``out`` (npz, no pickle), every rank reads the same file."""
    path = os.path.join(out, f"{name}-pairs-{max_len}-tokens.npz")
    if dist.get_rank() == 0 and not os.path.exists(path):
        from ..lengths.tasks import labeled_pairs
        from ..lengths.tokenizer import get_tokenizer

        texts = [pair for _, pair in labeled_pairs(name)]
        enc = get_tokenizer().encode_batch([a for a, _ in texts] + [b for _, b in texts])
        sides = [
            [np.asarray(e.ids[:max_len], dtype=np.int32) for e in half]
            for half in (enc[: len(texts)], enc[len(texts) :])
        ]
        keep = [i for i in range(len(texts)) if len(sides[0][i]) and len(sides[1][i])]
        with atomic_path(path) as tmp:  # ranks of other runs may be reading it
            np.savez(
                tmp,
                **{
                    f"{side}_{part}": arr
                    for side, ids in zip(("inputs", "targets"), sides)
                    for part, arr in (
                        ("flat", np.concatenate([ids[i] for i in keep])),
                        ("offsets", np.cumsum([0] + [len(ids[i]) for i in keep])),
                    )
                },
            )
    dist.barrier()
    with np.load(path) as z:  # each read of an npz member reads it whole: once per side
        split = []
        for side in ("inputs", "targets"):
            flat, off = z[f"{side}_flat"], z[f"{side}_offsets"]
            split.append([flat[a:b] for a, b in zip(off[:-1], off[1:])])
    data = [{"input_ids": x, "labels": y} for x, y in zip(*split)]
    return data, np.array([[len(x), len(y)] for x, y in zip(*split)], dtype=np.int64)


def run_mode(mode: str, args, data: list[dict], lengths: np.ndarray, model_cfg: dict, device) -> list[dict]:
    # the tables priced from the config, as a user's JSON config names them (cost.from_config.pair_cost_model)
    config = {
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "dyn_plugin": {
            "cost_model": {"kind": "profile", "profile": args.profile},
            "microbatching": {"global_tokens": args.global_tokens, "max_seq_len": args.max_len, "method": MODES[mode]},
            "cluster": {
                "devices_per_node": dist.get_world_size(),
                "device": {"memory_mb": args.memory_mb or device_memory_mb(device)},
            },
            "calibration": {"enabled": mode != "dyn_plugin_static"},
        },
    }
    torch.manual_seed(0)
    model = build_seq2seq_lm(model_cfg)
    engine, _, loader, _ = deepspeed_ext.initialize(
        model=model,
        config=config,
        dataset=data,
        lengths=lengths,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        seed=args.seed,
    )
    records = []
    total = args.warmup + args.steps
    bar = tqdm(total=total, desc=f"{mode:>12}", disable=dist.get_rank() != 0)
    for n, step in enumerate(loader):
        real = sum(int(lengths[i].sum()) for mb in step.sample_ids for i in mb)  # both sides' real tokens
        # token slots of both sides, padded or packed: the plan's (rows, input width, target width)
        slots = sum(int(d.shape[0] * (d.shape[1] + d.shape[2])) for d in step.loaded)
        ms, loss, (real, slots) = timed_step(engine, step, device, (real, slots))
        bar.update()
        if n >= args.warmup:
            records.append(step_record(mode, n, step, ms, real, slots, loss))
        if n + 1 == total:
            break
    bar.close()
    engine.destroy()  # ZeRO's gradient hooks hold the engine in a cycle no collection frees (train_deepspeed.run_mode)
    return records


def cpu_pair_profile(path: str) -> tuple[dict, EncoderDecoderCostModel]:
    """The tables ``--profile`` names and their cost model, checked as every rank's
    ``deepspeed_ext.initialize`` will check them (``cost.from_config.pair_cost_model``: the model they
    record, trained in fp32), or SystemExit saying what is wrong, before any rank joins the group."""
    redo = "(dynplugin profile --model tiny-t5)"
    try:
        raw = read_pair_tables(path, "--profile")
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{exc}; make one {redo}") from None
    if not isinstance(raw.get("model"), dict) or "config" not in raw["model"]:
        raise SystemExit(f"--profile {path}: not a CPU profile of an encoder-decoder; make one {redo}")
    try:
        model = hf_config(raw["model"]["config"])
        cost = pair_cost_model(CostModelConfig(kind="profile", profile=path), model, "fp32")
    except (KeyError, TypeError) as exc:
        raise SystemExit(
            f"--profile {path}: its tables are incomplete or malformed ({exc!r}); make one {redo}"
        ) from None
    except ValueError as exc:
        raise SystemExit(f"--profile {path}: {exc}; make one {redo}") from None
    return raw, cost


def main() -> None:
    p = common_parser(
        __doc__,
        "out/train-t5",
        "tables of the encoder-decoder measured on this machine (dynplugin profile --model tiny-t5 --ranks 2 "
        "--threads 1); they price the plans and name the model trained",
    )
    p.set_defaults(lengths="tasks", max_len=512, global_tokens=8192)
    p.add_argument("--modes", help="default: every trainable mode (dyn_plugin_static under --background-load only)")
    p.add_argument("--memory-mb", type=float, help="memory the plans may fill per rank (default 8000 on CPU)")
    add_background_load_argument(p)
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # from the deepspeed launcher
    args = p.parse_args()
    if not args.profile:
        raise SystemExit("--profile is required: the encoder-decoder's tables (dynplugin profile --model tiny-t5)")
    modes = (
        args.modes.split(",")
        if args.modes
        else [m for m in trainable_modes() if args.background_load or m != "dyn_plugin_static"]
    )
    unknown = [m for m in modes if m not in trainable_modes()]
    if unknown:
        raise SystemExit(
            f"--modes: unknown {', '.join(unknown)}; trainable on pairs today are {', '.join(trainable_modes())}"
        )
    raw, cost = cpu_pair_profile(args.profile)
    deepspeed_ext.skip_cpu_shm_build()
    import deepspeed

    device = use_rank_device()
    if device.type != "cpu":
        raise SystemExit("the encoder-decoder benchmark trains on CPU ranks (its profile is a CPU, fp32 one)")
    deepspeed.init_distributed(dist_backend="gloo")
    os.makedirs(args.out, exist_ok=True)
    data, lengths = tokenized_pairs(args.lengths, args.max_len, args.out)
    records = []
    for mode in modes:
        records += run_mode(mode, args, data, lengths, raw["model"]["config"], device)
    if dist.get_rank() == 0:
        preamble = batchings_preamble(
            f"# Training demo: {cost.name}, DeepSpeed ZeRO-1, {dist.get_world_size()} {ranks_on(device, 'fp32')}",
            args,
            "padded: each side padded to the maximum length, a fixed number of pairs per micro-batch; token_budget: "
            "pairs grouped under a token budget on input + target, each side padded to its longest; packing: rows of "
            "whole pairs, each side's row the maximum length wide (T5 packing per side); dyn_plugin_static: the plugin "
            "without online calibration."
            + (f" {args.background_load} busy processes ran beside the training." if args.background_load else ""),
            data=f"(input, target) pairs of the bundled '{args.lengths}' distribution, each side cut to "
            f"{args.max_len} tokens",
        )
        finish_batchings(
            records, modes, [b for b in BASELINES if b in modes], args.out, preamble, budget=args.global_tokens
        )
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # DeepSpeed sometimes aborts in its exit handlers on CPU


if __name__ == "__main__":
    main()
