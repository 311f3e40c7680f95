"""On a GPU: dyn_varlen's flash varlen path for grouped-query attention and sliding windows.

    python3 benchmarks/gpu-2026-11-26/check_gqa.py --out OUT/check.json     # from the package root

Three parts, cheapest first; the JSON is rewritten after each, so a run cut short keeps what it did:

- exact: the flash path (one varlen_attn call per packed row) against the per-document loop the
  CPU runs (varlen_attn hidden), 32 query / 8 key-value heads, with and without a window, bf16,
  fp16 and fp32 (fp32 and the soft-cap stay on the loop: the check asserts which path each took),
  forward and gradients; both also against the loop in fp64 on the same rounded inputs. Worst error relative to
  the largest value; exits non-zero past 2%.
- time: one GQA attention layer (32/8 heads of 128, bf16) over 8192 tokens of short documents,
  forward and forward+backward, one flash call against the per-document loop (CUDA events).
- syncs: one training step (forward, backward, AdamW) of a tiny random GQA Llama in bf16 through
  the dyn_varlen backend as the benchmarks build it (``build_causal_lm``), on one packed row,
  under ``torch.cuda.set_sync_debug_mode("warn")``: how many synchronizing calls it reports and
  from which line (the Python frame that made the call; the backward's come out of the autograd
  engine without one), flash path and per-document loop.

``--device cpu --tiny`` runs the same code at toy sizes on the CPU (the loop against itself: a
test of the script, not of the kernel).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import itertools
import json
import sys
import time
import traceback
import warnings

import torch

from dyn_plugin.models import varlen_attention as va

TOLERANCE = 0.02


@contextlib.contextmanager
def counting_flash():
    """Count the varlen_attn calls inside (0: the call took SDPA or the per-document loop)."""
    calls = [0]
    kernel = va.varlen_attn

    def counted(*args, **kwargs):
        calls[0] += 1
        return kernel(*args, **kwargs)

    va.varlen_attn = counted if kernel is not None else None
    try:
        yield calls
    finally:
        va.varlen_attn = kernel


@contextlib.contextmanager
def per_document_loop():
    """The reference: varlen_attn hidden, so every call runs the per-document loop."""
    kernel, va.varlen_attn = va.varlen_attn, None
    try:
        yield
    finally:
        va.varlen_attn = kernel


def attend(q, k, v, pos, window, softcap):
    module = torch.nn.Module().train()
    kwargs = {"position_ids": pos, "sliding_window": window, "softcap": softcap}
    return va.varlen_attention(module, q, k, v, None, scaling=q.shape[-1] ** -0.5, **kwargs)[0]


def out_and_grads(q, k, v, pos, window, softcap, weight):
    for t in (q, k, v):
        t.grad = None
    out = attend(q, k, v, pos, window, softcap)
    (out.double() * weight).sum().backward()  # a fixed random projection: gradients of every output
    return [out.detach().double()] + [t.grad.double() for t in (q, k, v)]


def relative(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def part_exact(dev, tiny: bool) -> dict:
    heads, kv, d = (4, 2, 16) if tiny else (32, 8, 128)
    layouts = [
        ("packed", [70, 3, 150, 1, 80] if tiny else [700, 31, 1500, 9, 809], 1),
        ("padded", [64] if tiny else [512], 3),
    ]
    # window 2: the smallest that an off-by-one changes everywhere and leaves every dq nonzero but the first
    cases = [(None, None), (64 if tiny else 256, None), (2, None), (None, 30.0)]
    rows, worst = [], 0.0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for layout, lens, b in layouts:
            s = sum(lens)
            pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0).to(dev) if layout == "packed" else None
            for window, softcap in cases:
                torch.manual_seed(0)
                base = [torch.randn(b, h, s, d, device=dev, dtype=torch.float64) for h in (heads, kv, kv)]
                weight = torch.randn(b, s, heads, d, device=dev, dtype=torch.float64)
                ins = [t.to(dtype).requires_grad_() for t in base]
                with counting_flash() as calls:
                    got = out_and_grads(*ins, pos, window, softcap, weight)
                with per_document_loop():
                    ref = out_and_grads(*ins, pos, window, softcap, weight)
                    # the same rounded inputs in fp64: what the kernel's own arithmetic costs
                    truth = out_and_grads(
                        *[t.detach().double().requires_grad_() for t in ins], pos, window, softcap, weight
                    )
                flash_expected = dev.type == "cuda" and va.flash_exact(ins[0], ins[1], 0.0, window, softcap)
                takes_kernel = flash_expected and (layout == "packed" or window is not None)
                path = "flash varlen" if takes_kernel else ("dense SDPA" if flash_expected else "per-document loop")
                if dev.type == "cuda" and (calls[0] > 0) != takes_kernel:
                    raise SystemExit(f"{dtype} {layout} window={window}: {calls[0]} varlen_attn calls, expected {path}")
                row = {
                    "dtype": str(dtype).removeprefix("torch."),
                    "layout": f"{layout} ({len(lens)} docs x {b} rows)",
                    "window": window,
                    "softcap": softcap,
                    "path": path,
                    "kernel_calls": calls[0],
                }
                for name, g, r, t in zip(("out", "dq", "dk", "dv"), got, ref, truth):
                    row[f"{name}_vs_loop"] = relative(g, r)
                    row[f"{name}_vs_fp64"] = relative(g, t)
                    row[f"{name}_loop_vs_fp64"] = relative(r, t)
                err = max(row[f"{n}_vs_loop"] for n in ("out", "dq", "dk", "dv"))
                row["worst_vs_loop"] = err
                if path != "per-document loop":
                    worst = max(worst, err)
                rows.append(row)
                print(
                    f"  {row['dtype']:8s} {row['layout']:22s} window={window!s:4s} softcap={softcap!s:4s} "
                    f"{path:17s} vs loop {err:.4f} (out {row['out_vs_loop']:.4f} dq {row['dq_vs_loop']:.4f} "
                    f"dk {row['dk_vs_loop']:.4f} dv {row['dv_vs_loop']:.4f}); vs fp64: "
                    f"{max(row[f'{n}_vs_fp64'] for n in ('out', 'dq', 'dk', 'dv')):.4f}, loop "
                    f"{max(row[f'{n}_loop_vs_fp64'] for n in ('out', 'dq', 'dk', 'dv')):.4f}",
                    flush=True,
                )
    print(f"flash path vs per-document loop: worst relative error {worst:.4f} (tolerance {TOLERANCE})", flush=True)
    return {"heads": heads, "kv_heads": kv, "head_dim": d, "rows": rows, "worst_vs_loop": worst}


def short_documents(total: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total:
        lens.append(int(torch.randint(16, 512, (1,), generator=g)))
    lens[-1] -= sum(lens) - total
    return lens


def timed(fn, dev, warmup: int, repeats: int) -> float:
    """Milliseconds per call: CUDA events around ``repeats`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) * 1e3 / repeats
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def part_time(dev, tiny: bool) -> dict:
    heads, kv, d, tokens = (4, 2, 16, 512) if tiny else (32, 8, 128, 8192)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    warmup, repeats = (1, 2) if tiny else (5, 20)
    lens = short_documents(tokens)
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0).to(dev)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, tokens, d, device=dev, dtype=dtype, requires_grad=True) for h in (heads, kv, kv))
    grad = torch.randn(1, tokens, heads, d, device=dev, dtype=dtype)
    result = {"tokens": tokens, "documents": len(lens), "longest": max(lens), "heads": heads, "kv_heads": kv}
    result["head_dim"], result["dtype"], result["ms"] = d, str(dtype).removeprefix("torch."), {}
    for window in (None, 256):
        for name, ctx in (("flash", contextlib.nullcontext), ("loop", per_document_loop)):
            with ctx():

                def forward():
                    with torch.no_grad():
                        attend(q, k, v, pos, window, None)

                def forward_backward():
                    attend(q, k, v, pos, window, None).backward(grad)

                key = f"{name}{'' if window is None else f' window={window}'}"
                result["ms"][key] = {
                    "forward": timed(forward, dev, warmup, repeats),
                    "forward+backward": timed(forward_backward, dev, warmup, repeats),
                }
            print(f"  {key:20s} " + "  ".join(f"{p} {ms:8.3f} ms" for p, ms in result["ms"][key].items()), flush=True)
    for window in ("", " window=256"):
        for p in ("forward", "forward+backward"):
            ratio = result["ms"][f"loop{window}"][p] / result["ms"][f"flash{window}"][p]
            print(f"  loop / flash{window} {p}: {ratio:.1f}x", flush=True)
    return result


class SyncLog:
    """Records each synchronizing-call warning with the Python stack it was raised under."""

    def __init__(self) -> None:
        self.phase = ""
        self.seen: collections.Counter = collections.Counter()

    def show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
        ours = [f for f in frames if "/dyn_plugin/" in f.filename or "/transformers/" in f.filename]
        where = ours[-1] if ours else frames[-1]
        src = f"{where.filename.split('/site-packages/')[-1].split('/work/')[-1]}:{where.lineno} {where.name}"
        self.seen[(self.phase, src, f"{filename.rsplit('/', 1)[-1]}:{lineno}")] += 1


def train_step(model, opt, batch, log: SyncLog | None) -> None:
    def phase(name):
        if log is not None:
            log.phase = name

    def flush():
        # a warning raised off the main thread (the autograd engine's) reaches Python at its next call into torch
        if log is not None and torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")

    phase("forward")
    loss = model(**batch, use_cache=False).loss
    flush()
    phase("backward")
    loss.backward()
    flush()
    phase("optimizer")
    opt.step()
    opt.zero_grad(set_to_none=True)
    flush()
    phase("after the step")


def part_syncs(dev, tiny: bool) -> dict:
    from dyn_plugin.models.hf import build_causal_lm

    cfg = dict(
        model_type="llama",
        hidden_size=64 if tiny else 512,
        intermediate_size=128 if tiny else 1408,
        num_hidden_layers=2 if tiny else 4,
        num_attention_heads=4 if tiny else 16,
        num_key_value_heads=2 if tiny else 4,
        vocab_size=256 if tiny else 4096,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    tokens = 512 if tiny else 4096
    lens = short_documents(tokens, seed=1)
    ids = torch.randint(0, cfg["vocab_size"], (1, tokens), device=dev)
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0).to(dev)
    labels = ids.clone()
    labels[pos == 0] = -100  # HF shifts: the label at a document's first token would be predicted across documents
    plain = {"input_ids": ids, "position_ids": pos, "labels": labels}
    # as the loader ships a packed row (dyn_plugin.runtime.collate): its documents' boundaries on
    # the device and the longest as a host int, so the kernel need not look for them
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
    shipped = {**plain, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lens), "max_length_k": max(lens)}
    result = {"model": cfg, "tokens": tokens, "documents": len(lens), "paths": {}}
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    paths = (
        ("flash", contextlib.nullcontext, plain),
        ("flash-shipped", contextlib.nullcontext, shipped),
        ("loop", per_document_loop, plain),
    )
    for name, ctx, batch in paths:
        torch.manual_seed(0)
        model = build_causal_lm(cfg).to(dev, dtype).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        with ctx():
            train_step(model, opt, batch, None)  # warm-up: first-call allocations and lazy inits
            if dev.type == "cuda":
                torch.cuda.synchronize()
            log = SyncLog()
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = log.show
                if dev.type == "cuda":
                    torch.cuda.set_sync_debug_mode("warn")
                try:  # a new position_ids tensor, as each micro-batch brings: the offsets cache misses
                    train_step(model, opt, {k: t.clone() if torch.is_tensor(t) else t for k, t in batch.items()}, log)
                finally:
                    if dev.type == "cuda":
                        torch.cuda.set_sync_debug_mode("default")
        per_phase = collections.Counter()
        for (ph, _, _), n in log.seen.items():
            per_phase[ph] += n
        result["paths"][name] = {
            "syncs": sum(log.seen.values()),
            "per_phase": dict(per_phase),
            "sources": [
                {"phase": ph, "source": src, "raised_at": at, "count": n} for (ph, src, at), n in log.seen.items()
            ],
        }
        print(f"  {name}: {sum(log.seen.values())} synchronizing calls in one step {dict(per_phase)}", flush=True)
        for (ph, src, at), n in sorted(log.seen.items()):
            print(f"    {n:3d} x {ph:9s} {src}  (warned at {at})", flush=True)
        del model, opt
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/gpu-gqa/check.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="toy sizes (a test of the script on CPU)")
    p.add_argument("--parts", default="exact,time,syncs")
    args = p.parse_args()
    dev = torch.device(args.device)
    results = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "varlen_attn": None if va.varlen_attn is None else str(inspect.signature(va.varlen_attn)),
    }
    print(f"torch {results['torch']} on {results['device']}; varlen_attn{results['varlen_attn']}", flush=True)
    failed = False
    for part in args.parts.split(","):
        print(f"== {part}", flush=True)
        t0 = time.perf_counter()
        try:
            results[part] = {"exact": part_exact, "time": part_time, "syncs": part_syncs}[part](dev, args.tiny)
        except Exception as e:  # keep going: the later parts are independent
            traceback.print_exc()
            results[part] = {"error": f"{type(e).__name__}: {e}"}
            failed = True
        results[part]["seconds"] = round(time.perf_counter() - t0, 1)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    exact = results.get("exact", {})
    return 1 if failed or exact.get("worst_vs_loop", 0.0) > TOLERANCE else 0


if __name__ == "__main__":
    sys.exit(main())
