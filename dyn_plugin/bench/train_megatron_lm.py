"""Megatron-LM's own ``pretrain_gpt.py`` trained several ways side by side on real code: padded, Megatron-LM's
packing and the plugin's plan (``dynplugin bench train --host megatron-lm``).

The same corpus as the other training benchmarks (the Python standard library's source, tokenized
with the plugin's offline BPE, documents truncated to ``--max-len``), written once as a Megatron
indexed dataset (``.bin``/``.idx``, one document per sequence) and passed to every run with
``--data-path``; the same tiny-llama shape as Megatron-LM flags; the same tokens per iteration
(``--global-batch-size`` x ``--seq-length``, ``--seq-length`` = ``--max-len``); 2 gloo CPU ranks, fp32:

- padded: the plugin's ``fixed_padding`` through its launcher (every document padded to the
  maximum length, what Megatron-LM users get with padded batches);
- megatron-lm: Megatron-LM alone (plain torchrun, only the CPU shims) on its own ``GPTDataset``
  samples, documents concatenated into ``--seq-length`` rows attending across each other: every
  token is a document token;
- megatron-lm-sdpa: the same with the plugin runs' core attention (torch's SDPA, the same result):
  Megatron-LM's local attention materialises the full score matrix with an unfused softmax, several
  times slower on CPU, so megatron-lm alone mixes the batching's gain with the kernel's; this
  baseline isolates the batching;
- dyn_plugin: the plugin's ``dynapipe`` plan through its launcher.

Each run is a separate ``pretrain_gpt.py`` (bench/megatron_lm_rank.py observing it): measured step
times and losses are parsed from Megatron-LM's log (``elapsed time per iteration (ms)``, the warm-up
iterations skipped); the plugin runs' ranks report each plan's predicted step time and their
document tokens and token slots. This module imports neither megatron_patches nor (until it writes
the corpus) megatron-core: the CLI imports it only to run the benchmark.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
from tqdm import tqdm

from ..atomic import write_json_atomic
from .train_common import (
    batchings_preamble,
    cost_model_section,
    plot_predictions,
    report,
    summarize,
    tokenized_corpus,
    write_results,
)

logger = logging.getLogger(__name__)

# mode -> the plugin's microbatching.method, or None: Megatron-LM alone
MODES = {
    "padded": "fixed_padding",
    "megatron-lm": None,
    "megatron-lm-sdpa": None,
    "dyn_plugin": "dynapipe",
    "dyn_plugin_static": "dynapipe",  # without online calibration: by default under --background-load only
}
# Megatron-LM alone: mode -> its core attention (bench/megatron_lm_rank.py)
ALONE = {"megatron-lm": "local", "megatron-lm-sdpa": "sdpa"}
BASELINES = ("padded", "megatron-lm", "megatron-lm-sdpa", "dyn_plugin_static")  # the ratios the report shows
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_lm_rank.py")
# NullTokenizer adds its end-of-document id after --vocab-size ids: 8191 + 1 = tiny-llama's 8192 embedding rows
# (the BPE's ids stay below 8192; the end-of-document id is never read, documents are not reset)
VOCAB_SIZE = 8191
# the tiny-llama preset (dyn_plugin.models.hf.PRESETS, bench/train_megatron.py's TINY_LLAMA) as Megatron-LM flags
MODEL = (
    "--num-layers 4 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 "
    f"--tokenizer-type NullTokenizer --vocab-size {VOCAB_SIZE} --make-vocab-size-divisible-by 128"
).split()
# what Megatron-LM needs on CPU gloo ranks (README, "Megatron-LM's pretrain_gpt.py"); Adam, constant rate, no
# clipping: bench/train_megatron.py's optimizer
CPU = (
    "--distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion "
    "--no-persist-layer-norm --optimizer adam --lr 1e-3 --lr-decay-style constant --clip-grad 0 --weight-decay 0 "
    "--eval-iters 0 --eval-interval 1000000 --log-interval 1 --split 100,0,0 --micro-batch-size 1"
).split()
STEP_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
LOSS = re.compile(r"lm loss: ([0-9.eE+-]+)")


def pretrain_gpt(path: str | None) -> str:
    """``pretrain_gpt.py`` of the Megatron-LM checkout ``path``; a clear error naming the option where it is not."""
    script = os.path.join(path or "", "pretrain_gpt.py")
    if not path or not os.path.isfile(script):
        raise ValueError(
            f"no Megatron-LM checkout with pretrain_gpt.py at {path or '(none given)'}: pass --megatron-lm PATH "
            "(or set $MEGATRON_LM) naming a Megatron-LM checkout (core_v0.16.1 is tested)"
        )
    return script


def write_corpus(args: argparse.Namespace) -> str:
    """The corpus as a Megatron indexed dataset in ``args.out``; its prefix (``--data-path``)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = os.path.join(os.path.abspath(args.out), f"{args.lengths}-{args.max_len}")
    if not os.path.exists(prefix + ".idx"):
        docs, _ = tokenized_corpus(args.lengths, args.max_len, args.out)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
        for doc in docs:
            builder.add_document(doc, [len(doc)])
        builder.finalize(prefix + ".idx")
        logger.info("wrote %d documents (%d tokens) to %s.bin/.idx", len(docs), sum(map(len, docs)), prefix)
    return prefix


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(mode: str, args: argparse.Namespace, script: str, prefix: str) -> list[dict]:
    """Train a fresh model ``args.warmup + args.steps`` iterations under ``mode``; one record per timed iteration."""
    folder = os.path.abspath(os.path.join(args.out, mode))
    os.makedirs(folder, exist_ok=True)
    for old in os.listdir(folder):  # the ranks append their steps: start each run empty
        if old.startswith("steps-"):
            os.remove(os.path.join(folder, old))
    iterations = args.warmup + args.steps
    gbs = args.global_tokens // args.max_len
    flags = MODEL + CPU
    flags += f"--seq-length {args.max_len} --max-position-embeddings {args.max_len} --global-batch-size {gbs}".split()
    flags += f"--train-iters {iterations} --data-path {prefix}".split()
    method = MODES[mode]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.path.dirname(script), os.environ.get("PYTHONPATH")) if p),
        "PET_MASTER_PORT": str(free_port()),  # torchrun's --master-port
        "OMP_NUM_THREADS": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "BENCH_MEGATRON_LM_OUT": folder,
        "BENCH_MEGATRON_LM_SCRIPT": script,
    }
    if method is None:
        env["BENCH_MEGATRON_LM_ALONE"] = ALONE[mode]
        if ALONE[mode] == "sdpa":  # SDPA only where no mask tensor is given: causality alone is the mask
            flags.append("--no-create-attention-mask-in-dataloader")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}", RANK_SCRIPT]
    else:
        cfg = os.path.join(folder, "dyn_plugin.json")
        plugin = {
            # the ranks run in the mode's folder: a relative profile path is the caller's
            "cost_model": cost_model_section(args.profile and os.path.abspath(args.profile), "fp32"),
            "microbatching": {"method": method, "max_seq_len": args.max_len},  # global_tokens: the flags' product
            "cluster": {"devices_per_node": args.ranks, "device": {"memory_mb": args.memory_mb}},
            "calibration": {"enabled": mode != "dyn_plugin_static"},
        }
        write_json_atomic(cfg, {"dyn_plugin": plugin})
        cmd = [sys.executable, "-m", "dyn_plugin", "megatron", "--dyn-plugin-config", cfg]
        cmd += ["--nproc-per-node", str(args.ranks), "--", RANK_SCRIPT]
    log = os.path.join(folder, "output.log")
    with open(log, "w") as f:
        done = subprocess.run(cmd + flags, env=env, cwd=folder, stdout=f, stderr=subprocess.STDOUT)
    with open(log) as f:
        output = f.read()
    if done.returncode != 0:
        raise RuntimeError(f"{mode}: pretrain_gpt.py failed (exit {done.returncode}), see {log}:\n{output[-3000:]}")
    step_ms = [float(x) for x in STEP_MS.findall(output)]
    losses = [float(x) for x in LOSS.findall(output)]
    if len(step_ms) != iterations or len(losses) != iterations:
        raise RuntimeError(f"{mode}: {len(step_ms)} iteration logs, {len(losses)} losses in {log}, {iterations} run")
    planned = plans(folder, iterations) if method else None
    records = []
    for n in range(args.warmup, iterations):
        tokens = gbs * args.max_len  # Megatron-LM's own samples: every token a document token
        real, slots, predicted = planned[n] if planned else (tokens, tokens, None)
        records.append(
            {
                "mode": mode,
                "step": n,
                "measured_ms": step_ms[n],
                "predicted_ms": predicted,
                "real_tokens": real,
                "token_slots": slots,
                "loss": losses[n],
            }
        )
    return records


def plans(folder: str, iterations: int) -> list[tuple[int, int, float]]:
    """Per iteration: (document tokens, token slots) over all ranks and the plan's predicted step time."""
    ranks = [
        [json.loads(line) for line in open(os.path.join(folder, name))]
        for name in sorted(os.listdir(folder))
        if name.startswith("steps-")
    ]
    if not ranks or any(len(r) != iterations for r in ranks):
        raise RuntimeError(f"{folder}: the ranks reported {[len(r) for r in ranks]} planned steps, {iterations} run")
    return [
        (
            sum(r[n]["real_tokens"] for r in ranks),
            sum(r[n]["token_slots"] for r in ranks),
            float(np.mean([r[n]["predicted_ms"] for r in ranks])),  # every rank prices the same plan
        )
        for n in range(iterations)
    ]


def bench_train_megatron_lm(args: argparse.Namespace) -> list[dict]:
    """Run every mode (Megatron-LM's default seed in each) and write the report into ``args.out``; the summary rows.
    ``args``: ``megatron_lm`` (the checkout), ``out``, ``profile``, ``lengths``, ``max_len``, ``global_tokens``,
    ``warmup``, ``steps``, ``ranks``, ``memory_mb``, ``modes`` (comma-separated, or None for every mode but
    dyn_plugin_static, which ``background_load`` > 0 adds), ``background_load`` (the busy processes the caller
    runs beside the training), ``json``."""
    script = pretrain_gpt(args.megatron_lm)
    if args.global_tokens % args.max_len:
        raise SystemExit(
            f"--global-tokens {args.global_tokens} is not a multiple of --max-len {args.max_len}: "
            "Megatron-LM's iteration is --global-batch-size samples of --seq-length (= --max-len) tokens"
        )
    modes = (
        args.modes.split(",") if args.modes else [m for m in MODES if args.background_load or m != "dyn_plugin_static"]
    )
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(
            f"--modes: unknown {', '.join(unknown)}; with --host megatron-lm choose from {', '.join(MODES)}"
        )
    os.makedirs(args.out, exist_ok=True)
    prefix = write_corpus(args)
    records = []
    for mode in tqdm(modes, desc="megatron-lm modes", disable=args.json):
        t0 = time.perf_counter()
        records += run_mode(mode, args, script, prefix)
        logger.info("%s trained in %.0f s", mode, time.perf_counter() - t0)
    rows = summarize(records, modes, BASELINES, args.global_tokens)
    write_results(args.out, records, rows)
    text = report(rows, args.out, preamble(args), BASELINES)
    plot_predictions(records, args.out)
    if not args.json:  # --json prints only the rows
        print("\n" + text)
        print(
            f"report: {args.out}/report.md, {args.out}/report.png, predicted vs measured per step: "
            f"{args.out}/prediction.png, per-step records: {args.out}/records.jsonl"
        )
    return rows


def preamble(args: argparse.Namespace) -> str:
    return batchings_preamble(
        f"# Training demo: Megatron-LM's pretrain_gpt.py (tiny-llama shape), Adam, {args.ranks} CPU ranks (gloo, fp32)",
        args,
        "padded: the plugin's fixed_padding (every document padded to the maximum length); megatron-lm: "
        "Megatron-LM alone on its GPTDataset samples (documents concatenated into --seq-length rows, attending "
        "across each other; hence its different loss), with Megatron's local attention (full score matrix, unfused "
        "softmax); megatron-lm-sdpa: the same with the plugin runs' attention kernel (torch's SDPA); dyn_plugin: "
        "the plugin's plan; dyn_plugin_static: the same without online calibration."
        + (f" {args.background_load} busy processes ran beside the training." if args.background_load else ""),
        how=", each a run of Megatron-LM's unmodified pretrain_gpt.py (step times from its log)",
    )
