"""Measure a real torch model and write a profile (see profile.py).

The whole model runs through the real HF forward (so masking, rotary embeddings and the loss
cost what they cost in training) at two depths, as DCP measured 2 layers and extrapolated;
the embedding is also timed alone. profile.fit_tables separates layer and head costs by
regressing over every depth and micro-batch at once.

Timings are the minimum over repeats: on a shared CPU, interference only ever adds time.
Memory is measured by :class:`~dyn_plugin.cost.memory.LiveMemory` in a separate pass (it
slows ops down).
"""
from __future__ import annotations

import datetime
import logging
import platform
import time
from dataclasses import asdict, dataclass

import numpy as np

from .model import LAYOUTS, RECOMPUTES, Layout, Recompute, round_up
from .profile import SCHEMA, VERSION, DeviceInfo, ModelInfo, Profile, Sample, fit_tables

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileGrid:
    seq_lens: tuple[int, ...] = (16, 64, 256, 1024)
    micro_batch_sizes: tuple[int, ...] = (1, 4, 16)
    max_tokens: int = 1024
    layouts: tuple[str, ...] = LAYOUTS
    recomputes: tuple[str, ...] = RECOMPUTES
    depths: tuple[int, int] = (1, 3)
    warmup: int = 1
    repeats: int = 5
    seed: int = 0

    def points(self) -> list[tuple[int, int]]:
        return [(s, n) for s in self.seq_lens for n in self.micro_batch_sizes if s * n <= self.max_tokens]


def micro_batch_lengths(layout: Layout, seq_len: int, n: int, rng: np.random.Generator) -> list[int]:
    """The sequences of one profiled micro-batch.

    Padded: n rows of seq_len. Packed: one document of seq_len (so the measured range reaches
    it) and n-1 of random lengths below it, so that tokens and attention pairs vary
    independently and the fit can tell them apart.
    """
    if layout == "padded":
        return [seq_len] * n
    return [seq_len] + [int(x) for x in rng.integers(max(1, seq_len // 4), seq_len + 1, size=n - 1)]


def make_inputs(seq_lens: list[int], layout: Layout, vocab: int, pad_multiple: int, rng: np.random.Generator):
    """input_ids, position_ids, labels of one micro-batch, as the plugin's collator lays them out."""
    import torch

    if layout == "padded":
        width = round_up(max(seq_lens), pad_multiple)
        ids = torch.from_numpy(rng.integers(0, vocab, size=(len(seq_lens), width)))
        labels = ids.clone()
        for i, s in enumerate(seq_lens):
            labels[i, s:] = -100
        return ids, None, labels
    total = sum(seq_lens)
    ids = torch.from_numpy(rng.integers(0, vocab, size=(1, total)))
    pos = torch.cat([torch.arange(s) for s in seq_lens]).unsqueeze(0)
    labels = ids.clone()
    starts = np.cumsum([0] + seq_lens[:-1])
    labels[0, starts] = -100  # no prediction across a document boundary
    return ids, pos, labels


def _set_recompute(model, recompute: Recompute) -> None:
    """Full: checkpoint every decoder layer. Selective: checkpoint only each attention block."""
    import functools

    import torch.utils.checkpoint as cp

    if recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif recompute == "selective":
        for layer in _decoder_layers(model):
            attn = getattr(layer, "self_attn", None) or getattr(layer, "attn")
            attn.forward = functools.partial(cp.checkpoint, attn.forward, use_reentrant=False)


def _decoder_layers(model):
    inner = getattr(model, "model", None) or getattr(model, "transformer")
    return getattr(inner, "layers", None) or getattr(inner, "h")


def _step(model, ids, pos, labels) -> tuple[float, float]:
    t0 = time.perf_counter()
    loss = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def _memory(model, ids, pos, labels) -> tuple[float, float]:
    """(stored, peak above the start) bytes of one forward+backward."""
    from .memory import LiveMemory

    with LiveMemory() as mem:
        base = mem.live
        loss = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss
        stored = mem.live - base
        mem.reset_peak()
        loss.backward()
        peak = mem.peak - base
        del loss
    return float(stored), float(max(peak, stored))


def _embedding_times(model, ids, repeats: int) -> tuple[float, float]:
    import torch

    emb = model.get_input_embeddings()
    fwd, bwd = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        out = emb(ids)
        t1 = time.perf_counter()
        out.backward(torch.ones_like(out))
        t2 = time.perf_counter()
        fwd.append((t1 - t0) * 1e3)
        bwd.append((t2 - t1) * 1e3)
    return min(fwd[1:]), min(bwd[1:])


def measure_model(model, seq_lens: list[int], layout: Layout, *, vocab: int, pad_multiple: int,
                  rng: np.random.Generator, warmup: int = 1, repeats: int = 3, memory: bool = True) -> dict[str, float]:
    """Forward/backward ms (min over repeats) and stored/peak bytes of one micro-batch through the whole model."""
    ids, pos, labels = make_inputs(seq_lens, layout, vocab, pad_multiple, rng)
    times = []
    for i in range(warmup + repeats):
        t = _step(model, ids, pos, labels)
        if i >= warmup:
            times.append(t)
    out = {"forward_ms": min(t[0] for t in times), "backward_ms": min(t[1] for t in times)}
    if memory:
        out["stored_bytes"], out["peak_bytes"] = _memory(model, ids, pos, labels)
    return out


def run_profile(model_cfg: dict, *, name: str = "model", grid: ProfileGrid = ProfileGrid(),
                threads: int | None = None, progress: bool = True) -> Profile:
    """Profile the model described by a HF config dict on the current device (CPU, fp32)."""
    import torch
    from tqdm import tqdm

    from ..models.hf import build_causal_lm

    if threads:
        torch.set_num_threads(threads)
    rng = np.random.default_rng(grid.seed)
    l1, l2 = grid.depths
    pad = 8
    points = grid.points()
    models = {}
    for depth in (l1, l2):
        for rc in grid.recomputes:
            torch.manual_seed(grid.seed)
            m = build_causal_lm(model_cfg, num_layers=depth).train()
            _set_recompute(m, rc)
            models[(depth, rc)] = m
    ref = models[(l1, grid.recomputes[0])]
    vocab = ref.config.vocab_size
    total = len(points) * len(grid.layouts) * len(grid.recomputes)
    samples: list[Sample] = []
    bar = tqdm(total=total, desc="profiling", unit="cfg", disable=not progress)
    for layout in grid.layouts:
        for s, n in points:
            lens = micro_batch_lengths(layout, s, n, rng)
            ids, _, _ = make_inputs(lens, layout, vocab, pad, rng)
            fwd, bwd = _embedding_times(ref, ids, grid.repeats)
            for rc in grid.recomputes:
                samples.append(Sample(component="embedding", layout=layout, recompute=rc, seq_lens=lens,
                                      forward_ms=fwd, backward_ms=bwd, stored_bytes=0.0, peak_bytes=0.0))
                for depth in (l1, l2):
                    vals = measure_model(models[(depth, rc)], lens, layout, vocab=vocab, pad_multiple=pad,
                                         rng=np.random.default_rng(0), warmup=grid.warmup, repeats=grid.repeats)
                    samples.append(Sample(component="model", num_layers=depth, layout=layout, recompute=rc,
                                          seq_lens=lens, **vals))
                bar.update()
    bar.close()
    params = _param_counts(ref, l1)
    profile = Profile(
        schema=SCHEMA,
        version=VERSION,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        model=ModelInfo(name=name, num_layers=_full_depth(model_cfg), params=params, dtype="fp32", config=model_cfg),
        device=DeviceInfo(type="cpu", name=platform.processor() or platform.machine(),
                          threads=torch.get_num_threads(), torch=torch.__version__),
        pad_multiple=pad,
        grid={k: list(v) if isinstance(v, tuple) else v for k, v in asdict(grid).items()},
        samples=samples,
    )
    return profile.model_copy(update={"tables": fit_tables(samples, pad)})


def _full_depth(cfg: dict) -> int:
    return int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or cfg["num_layers"])


def _param_counts(model, depth: int) -> dict[str, float]:
    layers = _decoder_layers(model)
    layer = sum(p.numel() for p in layers[0].parameters())
    embedding = sum(p.numel() for p in model.get_input_embeddings().parameters())
    total = sum(p.numel() for p in model.parameters())
    return {"embedding": float(embedding), "layer": float(layer), "head": float(total - embedding - depth * layer)}


def validate(profile: Profile, model_cfg: dict, *, count: int = 16, max_tokens: int | None = None,
             recompute: Recompute = "none", seed: int = 1, progress: bool = True) -> dict:
    """Held-out check: random micro-batches (padded and packed) through the full-depth model,
    measured, against the fitted cost model's prediction. Returns per-case figures and the
    mean/max absolute percentage error of the step time (forward + backward)."""
    import torch
    from tqdm import tqdm

    from ..models.hf import build_causal_lm
    from .profile import cost_model_from_profile

    cost = cost_model_from_profile(profile)
    rng = np.random.default_rng(seed)
    budget = max_tokens or int(profile.grid.get("max_tokens", 1024))
    max_len = int(max(profile.grid.get("seq_lens", [budget])))
    torch.manual_seed(seed)
    model = build_causal_lm(model_cfg).train()
    _set_recompute(model, recompute)
    cases = []
    for i in tqdm(range(count), desc="validating", unit="mb", disable=not progress):
        layout: Layout = "padded" if i % 2 == 0 else "packed"
        lens = _random_micro_batch(rng, budget, max_len, layout, profile.pad_multiple)
        measured = measure_model(model, lens, layout, vocab=model.config.vocab_size,
                                 pad_multiple=profile.pad_multiple, rng=rng, memory=False)
        pred = cost.micro_batch_cost(lens, layout=layout, recompute=recompute)
        m, p = measured["forward_ms"] + measured["backward_ms"], pred.time_ms
        cases.append({"layout": layout, "seq_lens": lens, "measured_ms": round(m, 3), "predicted_ms": round(p, 3),
                      "error": round(abs(p - m) / m, 4)})
    errors = [c["error"] for c in cases]
    return {"recompute": recompute, "num_layers": model.config.num_hidden_layers, "count": count,
            "mape": float(np.mean(errors)), "max_ape": float(np.max(errors)), "cases": cases}


def _random_micro_batch(rng: np.random.Generator, budget: int, max_len: int, layout: Layout, pad: int) -> list[int]:
    """Random lengths (log-uniform, so short and long both appear) until the token budget is used."""
    lens: list[int] = []
    while True:
        s = int(np.exp(rng.uniform(np.log(8), np.log(max_len))))
        trial = lens + [s]
        width = round_up(max(trial), pad) * len(trial) if layout == "padded" else sum(trial)
        if width > budget:
            return lens or [min(s, budget)]
        lens = trial
        if rng.random() < 0.25:
            return lens
