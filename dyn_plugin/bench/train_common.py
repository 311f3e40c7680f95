"""What the side-by-side training benchmarks share (train_deepspeed.py and train_megatron.py, the
batchings under DeepSpeed and Megatron; train_fsdp.py, the sharding plans under FSDP2): their
common flags, the rank's device and training precision, real token ids, the cost model that
prices their plans, the batchings' summary rows and report (the same figures whichever host
trained), and the files rank 0 writes (records.jsonl, summary.json).

Token ids: a bundled corpus tokenized with the plugin's offline BPE. Rank 0 tokenizes
(documents truncated to ``max_len`` tokens) and writes an npz (no pickle); every rank then reads
the same file, so all ranks train on identical ids.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..atomic import atomic_path, write_atomic, write_json_atomic
from ..device import rank_device


def common_parser(doc: str, out: str, profile_help: str, steps_help: str | None = None) -> argparse.ArgumentParser:
    """The flags every training benchmark takes (its description: ``doc``'s first paragraph);
    each host adds its own (``--model``, ``--modes``, ``--memory-mb``, ...)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--profile", help=profile_help)
    p.add_argument("--out", default=out)
    p.add_argument("--lengths", default="code", help="corpus: code, prose or mixture")
    p.add_argument("--max-len", type=int, default=4096, help="sequences are truncated to this many tokens")
    p.add_argument("--global-tokens", type=int, default=16384, help="tokens per global batch")
    p.add_argument("--steps", type=int, default=4, help=steps_help)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p


def add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="tiny-llama",
        help="preset (see dyn_plugin.models.hf.PRESETS) or HF config.json; the one the profile measured",
    )


def add_background_load_argument(p: argparse.ArgumentParser) -> None:
    """``--background-load``, as the launching bench (bench/train.py) passes it to a rank module."""
    p.add_argument(
        "--background-load",
        type=int,
        default=0,
        help="busy processes the launching bench runs beside the training (recorded; with it the modes include "
        "dyn_plugin_static, the plugin without online calibration)",
    )


def use_rank_device() -> torch.device:
    """This rank's device (the host core's answer), made the current CUDA device where it is a GPU."""
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def profile_dtype(profile: str | None, device: torch.device) -> str:
    """Train in the precision the profile measured; without one, bf16 on GPUs and fp32 on CPU."""
    from ..cost.profile import load_profile

    return load_profile(profile).device.dtype if profile else ("bf16" if device.type == "cuda" else "fp32")


def ranks_on(device: torch.device, dtype: str) -> str:
    """What the ranks run on, for the reports' titles."""
    if device.type == "cuda":
        return f"GPU ranks ({torch.cuda.get_device_name(device)}, NCCL, {dtype})"
    return f"CPU ranks (gloo, {dtype})"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_record(mode: str, n: int, step, ms: float, real: float, slots: float, loss: float, **extra) -> dict:
    """One measured step of a training benchmark, as every host's records hold it."""
    return {
        "mode": mode,
        "step": n,
        "measured_ms": ms,
        "predicted_ms": step.predicted_ms,
        "real_tokens": real,
        "token_slots": slots,
        "loss": loss,
        "micro_batches": len(step.micro_batches),
        **extra,
    }


def timed_step(engine, step, device: torch.device, counts: Sequence[float], timings: list | None = None):
    """One planned step under DeepSpeed, timed as every batching is: all ranks start together
    and the clock stops when the slowest has finished (its kernels run, not just queued).
    ``counts``: this rank's figures (real tokens, token slots, ...), summed over the ranks.
    Returns (ms, loss, the summed counts)."""
    import deepspeed_ext

    summed = torch.tensor(list(counts), dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    loss = deepspeed_ext.train_step(engine, step, timings)
    synchronize(device)  # once per step: the step's kernels have run, not just been queued
    dist.barrier()
    ms = (time.perf_counter() - t0) * 1e3
    dist.all_reduce(summed)
    return ms, loss, summed.tolist()


def write_results(out: str, records: list[dict], rows: list[dict]) -> None:
    """Rank 0's files: ``out``/records.jsonl (one line per timed step) and summary.json (the rows
    ``dynplugin bench`` prints)."""
    write_atomic(os.path.join(out, "records.jsonl"), "".join(json.dumps(r) + "\n" for r in records))
    write_json_atomic(os.path.join(out, "summary.json"), rows)


def batchings_preamble(
    title: str, args: argparse.Namespace, legend: str, how: str = "", data: str | None = None
) -> str:
    """The batching reports' text above the table: ``title``, the run (``data``: what it trained on,
    by default the corpus; ``how``: how each step ran), what the modes mean (``legend``) and how the
    prediction is scored."""
    data = data or f"Python standard library source ({args.lengths}), sequences up to {args.max_len} tokens"
    return (
        f"{title}\n\n{data}, "
        f"{args.global_tokens:,} tokens per global batch, {args.steps} steps per mode after {args.warmup} "
        f"warm-up{how}.\nEffective tokens/s counts non-padding tokens. {legend} Predicted step time: the plan's "
        f"simulated time ({cost_model_label(args.profile)}), the gradient all-reduce and optimizer step included; "
        "prediction error: mean absolute percentage error per step.\n\n"
    )


def finish_batchings(
    records: list[dict],
    modes: Iterable[str],
    baselines: Sequence[str],
    out: str,
    preamble: str,
    also: str = "",
    *,
    budget: int,
) -> None:
    """The batching benchmarks' end on rank 0: summary rows, records.jsonl, summary.json, report.md
    and report.png written, the report printed (``also``: more files to name after it; ``budget``:
    the global batch's token budget, which ``budget_filled`` is the share of)."""
    rows = summarize(records, modes, baselines, budget)
    write_results(out, records, rows)
    print("\n" + report(rows, out, preamble, baselines))
    plot_predictions(records, out)
    print(
        f"report: {out}/report.md, {out}/report.png, predicted vs measured per step: {out}/prediction.png, "
        f"per-step records: {out}/records.jsonl" + also
    )


def plot_predictions(records: list[dict], out: str) -> None:
    """``out``/prediction.png: each planned mode's predicted and measured step time over the run (the
    online calibration's effect shows as the predicted line meeting the measured one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in records if r["predicted_ms"] is not None))
    if not modes:
        return
    fig, axes = plt.subplots(1, len(modes), figsize=(3.6 * len(modes), 3.2), sharey=True, squeeze=False)
    for ax, mode in zip(axes[0], modes):
        rs = [r for r in records if r["mode"] == mode]
        steps = [r["step"] for r in rs]
        ax.plot(steps, [r["measured_ms"] for r in rs], "o-", ms=3, label="measured", color="#4c72b0")
        ax.plot(steps, [r["predicted_ms"] for r in rs], "s--", ms=3, label="predicted", color="#dd8452")
        ax.set_title(f"{mode}: error {_mape(rs):.0%}", fontsize=9)
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("step time (ms)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(os.path.join(out, "prediction.png")) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def tokenized_corpus(name: str, max_len: int, out: str) -> tuple[list[np.ndarray], np.ndarray]:
    """The documents of corpus ``name`` (code, prose or mixture) as token ids of at most ``max_len``
    tokens (one-token documents dropped: nothing to predict), and their lengths; cached in ``out``.
    Called on every rank of a process group, or in one process without one (bench/train_megatron_lm.py
    writes the corpus before launching the ranks)."""
    path = os.path.join(out, f"{name}-{max_len}-tokens.npz")  # the cap is part of the key: ids differ per cap
    ranked = dist.is_initialized()
    if (not ranked or dist.get_rank() == 0) and not os.path.exists(path):
        from ..lengths.corpus import iter_documents
        from ..lengths.tokenizer import get_tokenizer

        ids = [
            np.asarray(e.ids[:max_len], dtype=np.int32)
            for e in get_tokenizer().encode_batch(list(iter_documents(name)))
        ]
        ids = [x for x in ids if len(x) > 1]
        with atomic_path(path) as tmp:  # ranks of other runs may be reading the cached corpus
            np.savez(tmp, flat=np.concatenate(ids), offsets=np.cumsum([0] + [len(x) for x in ids]))
    if ranked:
        dist.barrier()
    z = np.load(path)
    flat, off = z["flat"], z["offsets"]
    docs = [flat[a:b] for a, b in zip(off[:-1], off[1:])]
    return docs, np.array([len(d) for d in docs])


def cost_model_section(profile: str | None, dtype: str) -> dict:
    """The measured profile when given, else the analytic model of the live model's shape
    (predicted times then come from nominal device figures, not this machine's)."""
    if profile:
        return {"kind": "profile", "profile": profile, "dtype": dtype}
    return {"kind": "analytic", "dtype": dtype}


def cost_model_label(profile: str | None) -> str:
    """Which cost model priced the plans, for the reports and the JSON rows."""
    return f"profile {profile}" if profile else "analytic (no --profile: predictions from nominal device figures)"


LATE_STEP = 10  # prediction_mape_after_10 counts the steps from this one (0-based, warm-up included)


def _mape(records: list[dict]) -> float | None:
    """Mean absolute percentage error of the records' predicted step times (None without any)."""
    if not records:
        return None
    return float(np.mean([abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in records]))


def summarize(records: list[dict], modes: Iterable[str], baselines: Sequence[str], budget: int) -> list[dict]:
    """One row per mode of ``modes`` that has records (in that order): effective (non-padding)
    tokens/s, padding fraction, measured and predicted step time, the prediction's mean absolute
    percentage error, the last loss, ``budget_filled`` (the share of the global batch's token budget
    ``budget`` its documents fill, on average), and ``speedup_vs_<mode>`` against each of ``baselines``
    that ran.
    A mode whose records predict nothing (``predicted_ms`` None: a run without the plugin's plans) has
    None for both prediction figures."""
    rows = []
    for mode in modes:
        rs = [r for r in records if r["mode"] == mode]
        if not rs:
            continue
        secs = sum(r["measured_ms"] for r in rs) / 1e3
        predicted = [r for r in rs if r["predicted_ms"] is not None]
        rows.append(
            {
                "mode": mode,
                "steps": len(rs),
                "effective_tokens_per_s": sum(r["real_tokens"] for r in rs) / secs,
                "padding_fraction": 1 - sum(r["real_tokens"] for r in rs) / sum(r["token_slots"] for r in rs),
                "budget_filled": sum(r["real_tokens"] for r in rs) / (budget * len(rs)),
                "measured_step_ms": secs * 1e3 / len(rs),
                "predicted_step_ms": float(np.mean([r["predicted_ms"] for r in predicted])) if predicted else None,
                "prediction_mape": _mape(predicted),
                # once online calibration has had its steps (the tenth on)
                "prediction_mape_after_10": _mape([r for r in predicted if r["step"] >= LATE_STEP]),
                "final_loss": rs[-1]["loss"],
                **_device_figures(rs),
            }
        )
    base = {r["mode"]: r["effective_tokens_per_s"] for r in rows}
    for r in rows:
        for mode in baselines:
            if mode in base:
                r[f"speedup_vs_{mode}"] = r["effective_tokens_per_s"] / base[mode]
    return rows


def _device_figures(rs: list[dict]) -> dict:
    """A mode's GPU figures where its records have them (bench.utilization): mean model FLOPs
    utilisation, and the largest peak memory measured and predicted."""

    def kept(key: str) -> list[float]:
        return [r[key] for r in rs if r.get(key) is not None]

    mfu, measured, predicted = kept("mfu"), kept("peak_mb_measured"), kept("peak_mb_predicted")
    return {
        "mfu": float(np.mean(mfu)) if mfu else None,
        "peak_mb_measured": max(measured) if measured else None,
        "peak_mb_predicted": max(predicted) if predicted else None,
    }


def _device_table(rows: list[dict]) -> str:
    """The GPU figures' table, empty where no mode has them (CPU runs)."""
    if all(r["mfu"] is None and r["peak_mb_measured"] is None for r in rows):
        return ""

    def cell(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    def error(r: dict) -> str:
        m, p = r["peak_mb_measured"], r["peak_mb_predicted"]
        return "-" if m is None or p is None else f"{(p - m) / m:+.1%}"

    return (
        "\nOn the GPU (MFU: model FLOPs of the real tokens, bench/utilization.py; peak: rank 0's allocated "
        "memory, measured by torch and predicted by the plan):\n\n"
        "| mode | MFU | peak MiB measured | predicted | predicted vs measured |\n|---|---|---|---|---|\n"
        + "".join(
            f"| {r['mode']} | {cell(r['mfu'], '.1%')} | {cell(r['peak_mb_measured'], ',.0f')} | "
            f"{cell(r['peak_mb_predicted'], ',.0f')} | {error(r)} |\n"
            for r in rows
        )
    )


def report(rows: list[dict], out: str, preamble: str, baselines: Sequence[str]) -> str:
    """Write ``out``/report.md (``preamble``, then one table row per mode with its ratios against the
    ``baselines`` that ran) and ``out``/report.png (effective tokens/s per mode); returns the text."""
    shown = [m for m in baselines if any(r["mode"] == m for r in rows)]  # ratios against the modes that ran
    head = (
        "| mode | effective tokens/s | " + "".join(f"vs {m} | " for m in shown) + "padding | step ms measured "
        "| predicted | prediction error | final loss |\n" + "|---" * (7 + len(shown)) + "|\n"
    )

    def vs(r: dict, mode: str) -> str:
        return f"{r[f'speedup_vs_{mode}']:.2f}x" if f"speedup_vs_{mode}" in r else "-"

    def predicted(r: dict) -> str:
        if r["predicted_step_ms"] is None:
            return "- | - | "
        return f"{r['predicted_step_ms']:,.0f} | {r['prediction_mape']:.1%} | "

    body = "".join(
        f"| {r['mode']} | {r['effective_tokens_per_s']:,.0f} | "
        + "".join(f"{vs(r, m)} | " for m in shown)
        + f"{r['padding_fraction']:.1%} | {r['measured_step_ms']:,.0f} | "
        + predicted(r)
        + f"{r['final_loss']:.3f} |\n"
        for r in rows
    )
    text = preamble + head + body + _device_table(rows)
    write_atomic(os.path.join(out, "report.md"), text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    colors = ["#c44e52", "#dd8452", "#8c8c8c", "#55a868", "#4c72b0", "#8172b3", "#937860", "#da8bc3"]
    bars = ax.bar([r["mode"] for r in rows], [r["effective_tokens_per_s"] for r in rows], color=colors[: len(rows)])
    ax.bar_label(
        bars,
        fontsize=8,
        labels=[f"{r['effective_tokens_per_s']:,.0f}\n({vs(r, shown[0]) if shown else '-'})" for r in rows],
    )
    ax.set_ylabel("effective tokens/s (non-padding)")
    ax.set_title(f"Same model, same data, {len(rows)} batchings")
    ax.set_ylim(0, max(r["effective_tokens_per_s"] for r in rows) * 1.25)
    fig.tight_layout()
    with atomic_path(os.path.join(out, "report.png")) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return text
