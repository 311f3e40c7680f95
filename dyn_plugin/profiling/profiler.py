"""Measure a real torch model and write a profile (see profile.py).

The whole model runs through the real HF forward (so masking, rotary embeddings and the loss
cost what they cost in training) at two depths, as DCP measured 2 layers and extrapolated;
the embedding is also timed alone. profile.fit_tables separates layer and head costs by
regressing over every depth and micro-batch at once.

Timings are the minimum over repeats: on a shared CPU, interference only ever adds time.
Memory is measured in a separate pass: on CPU by :class:`~dyn_plugin.profiling.memory.LiveMemory`
(it slows ops down), on CUDA from the allocator's statistics (device.py).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from dataclasses import asdict, dataclass

import numpy as np

from ..cost.model import Layout, Precision, Recompute, StageSpec, features, round_up
from ..cost.profile import (
    SCHEMA,
    VERSION,
    CollectiveSamples,
    ModelInfo,
    Profile,
    Sample,
    UpdateSamples,
    cost_model_from_profile,
    fit_tables,
)
from ..cost.shape import shape_from_config
from ..cost.table import evaluate_checkpointed
from ..models.recompute import RecomputeSwitch, decoder_layers
from .allocator import stable_cpu_allocator
from .collective import measure_collectives
from .device import Target, measures
from .optimizer import measure_optimizer
from .shadow import ShadowLoad
from .workload import Inputs, ProfileGrid, backward, loss_closure, make_inputs, micro_batch_lengths, timed_step

logger = logging.getLogger(__name__)


def memory_of(model, inputs: Inputs) -> tuple[float, float]:
    """(stored, peak above the start) bytes of one forward+backward."""
    _, probe = measures(inputs.ids.device.type)
    return probe(loss_closure(model, inputs), backward)


def _embedding_times(model, ids, repeats: int) -> tuple[float, float]:
    import torch

    clock, _ = measures(ids.device.type)
    emb = model.get_input_embeddings()
    times = [clock(lambda: emb(ids), lambda out: out.backward(torch.ones_like(out))) for _ in range(repeats + 1)]
    return min(f for f, _ in times[1:]), min(b for _, b in times[1:])


@dataclass
class Job:
    """One micro-batch through one model, with its inputs built once."""

    model: object
    inputs: Inputs

    def run(self) -> tuple[float, float]:
        return timed_step(self.model, self.inputs)


@dataclass
class WeightJob(Job):
    """The same with its backward split (models/split_backward.py, as the pipeline engine runs it):
    (forward and I, W) ms, W the linear layers' weight gradients alone."""

    def run(self) -> tuple[float, float]:
        from ..models.split_backward import split_backward

        split = split_backward(self.model)
        clock, _ = measures(self.inputs.ids.device.type)

        def forward_and_input():
            with split.deferring("profile"):
                backward(loss_closure(self.model, self.inputs)())

        return clock(forward_and_input, lambda _: split.weights("profile"))


def time_round_robin(
    jobs: list[Job], *, warmup: int, repeats: int, seed: int = 0, bar=None
) -> list[tuple[float, float]]:
    """(forward, backward) ms of each job: the minimum over ``repeats`` rounds.

    Each round runs every job once, in a fresh random order, so a slow spell of a shared
    machine hits all jobs alike instead of biasing whichever ran during it, and the minimum
    compares every job at the machine's best.
    """
    rng = np.random.default_rng(seed)
    best = [(np.inf, np.inf)] * len(jobs)
    for job in jobs:
        for _ in range(warmup):
            job.run()
    for _ in range(repeats):
        for i in rng.permutation(len(jobs)):
            f, b = jobs[i].run()
            best[i] = (min(best[i][0], f), min(best[i][1], b))
        if bar is not None:
            bar.update()
    return best


def prepared(target: Target | None, fixed_allocator: bool, threads: int | None) -> Target:
    """The profiling process set up, for any model: the target (default: CPU, fp32), glibc's malloc
    thresholds pinned where ``fixed_allocator`` (a GPU tensor does not go through it), the threads."""
    import torch

    target = target or Target(torch.device("cpu"), "fp32")
    if fixed_allocator and target.device.type != "cuda":
        stable_cpu_allocator()
    if threads:
        torch.set_num_threads(threads)
    return target


def measure_jobs(
    model_cfg: dict, run: ProfileRun, target: Target, jobs: list[Job], update_models: list, *, what: str
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The one profiler loop, for any model: ``jobs`` timed round-robin (``time_round_robin``) as
    ``run`` says, on CPU beside ``run.ranks`` - 1 shadow ranks training the same model (GPU ranks do
    not share their device), then the optimizer step over ``update_models``' parameters; with a
    progress bar of rounds. Returns each job's (forward, backward) ms and the optimizer's
    (parameters, ms) points."""
    from tqdm import tqdm

    grid = run.grid
    bar = tqdm(total=grid.repeats, desc=f"profiling {len(jobs)} {what}", unit="round", disable=not run.progress)
    shadow = run.ranks > 1 and target.device.type != "cuda"
    load = ShadowLoad(model_cfg, grid, count=run.ranks - 1, threads=run.threads) if shadow else contextlib.nullcontext()
    with load:
        times = time_round_robin(jobs, warmup=grid.warmup, repeats=grid.repeats, seed=grid.seed, bar=bar)
        bar.close()
        optimizer = measure_optimizer(update_models, grid.repeats, target=target)
    return times, optimizer


@dataclass(frozen=True)
class ProfileRun:
    """How a profile is measured, whatever the model (``run_profile``; an encoder-decoder's,
    ``pairs.run_pair_profile``): the ``name`` it records, the ``grid`` of micro-batches, ``validate``
    held-out micro-batches, torch's ``threads``, glibc's malloc thresholds pinned
    (``fixed_allocator``, see allocator.py; off only to see what it buys), a ``progress`` bar, the
    ``ranks`` it measures as one of, and the ``target`` device and dtype (default: CPU, fp32)."""

    name: str = "model"
    grid: ProfileGrid = ProfileGrid()
    validate: int = 16
    threads: int | None = None
    fixed_allocator: bool = True
    progress: bool = True
    ranks: int = 1
    target: Target | None = None


def run_profile(model_cfg: dict, run: ProfileRun = ProfileRun()) -> Profile:
    """Profile the model described by a HF config dict as ``run`` says.

    On CUDA the models and inputs live on the GPU in the target's dtype; a half-precision
    target's optimizer step is timed over fp32 master weights, as mixed-precision training keeps.

    ``validate`` > 0 also times that many held-out micro-batches (random lengths, padded and
    packed, through the full-depth model with the first recompute mode) in the same rounds as
    the profile, so that drift of a shared machine cannot pass for model error, and records
    how far the fit's predictions are from them.

    ``ranks`` > 1 measures as one of that many training ranks on this host: on CPU, ranks-1
    processes train the same model beside it while it times (shadow.py); the gradient all-reduce
    and sequence parallelism's all-to-all and ring exchange are measured among ``ranks``
    processes, and so are sharded data parallelism's all-gather and reduce-scatter (on CUDA, one
    process per GPU: with fewer GPUs than ranks they are left unmeasured and priced from the
    cluster's link); the optimizer step is measured in every case (update.py).
    """
    import torch

    from ..models.hf import build_causal_lm, hf_config

    grid = run.grid
    target = prepared(run.target, run.fixed_allocator, run.threads)
    cuda = target.device.type == "cuda"
    rng = np.random.default_rng(grid.seed)
    l1, l2 = grid.depths
    pad = 8
    models = {}
    for depth in (l1, l2):
        for rc in grid.recomputes:
            torch.manual_seed(grid.seed)
            models[(depth, rc)] = _on(build_causal_lm(model_cfg, num_layers=depth).train(), target)
            RecomputeSwitch(models[(depth, rc)]).set(rc)
    ref = models[(l1, grid.recomputes[0])]
    vocab = ref.config.vocab_size
    # One job per (layout, micro-batch, recompute, depth); memory is measured once per job.
    keys, jobs, embedding = [], [], {}
    for layout in grid.layouts:
        for s, n in grid.points():
            lens = micro_batch_lengths(layout, s, n, rng)
            inputs = make_inputs(lens, layout, vocab, pad, rng).to(target.device)
            embedding[(layout, tuple(lens))] = _embedding_times(ref, inputs.ids, grid.repeats)
            for rc in grid.recomputes:
                for depth in (l1, l2):
                    keys.append((layout, lens, rc, depth))
                    jobs.append(Job(models[(depth, rc)], inputs))
    # W timed apart on a few micro-batches of each layout spanning the grid's sizes, at both depths:
    # it has no attention term, and a recompute mode changes I, not W
    plain = "none" if "none" in grid.recomputes else grid.recomputes[0]
    weight_keys, weight_jobs = [], []
    for layout in grid.layouts:
        points = sorted({(lay, tuple(lens)) for lay, lens, _, _ in keys if lay == layout}, key=lambda k: sum(k[1]))
        for _, lens in [points[i] for i in sorted({0, len(points) // 3, 2 * len(points) // 3, len(points) - 1})]:
            job = jobs[keys.index((layout, list(lens), plain, l1))]
            for depth in (l1, l2):
                weight_keys.append((layout, lens, depth))
                weight_jobs.append(WeightJob(models[(depth, plain)], job.inputs))
    held_out = _held_out_cases(keys, run.validate, grid, rng, pad) if run.validate else []
    held_jobs = []
    if held_out:
        torch.manual_seed(grid.seed)
        full = _on(build_causal_lm(model_cfg).train(), target)
        RecomputeSwitch(full).set(grid.recomputes[0])
        held_jobs = [
            Job(full, make_inputs(c["seq_lens"], c["layout"], vocab, pad, rng).to(target.device)) for c in held_out
        ]
    updated = [models[(l1, grid.recomputes[0])], models[(l2, grid.recomputes[0])]]
    timed, optimizer = measure_jobs(
        model_cfg, run, target, jobs + held_jobs + weight_jobs, updated, what="micro-batches"
    )
    times = timed[: len(jobs) + len(held_jobs)]
    weights = {key: w for key, (_, w) in zip(weight_keys, timed[len(times) :])}
    params = _param_counts(ref, l1)
    # the full-depth model's gradients, whether or not a full-depth model was built
    grad_bytes = Precision.of(target.dtype).grad * (
        params["embedding"] + params["head"] + params["layer"] * _full_depth(model_cfg)
    )
    backend = "nccl" if cuda else "gloo"
    measured = {}
    if run.ranks > 1 and cuda and torch.cuda.device_count() < run.ranks:
        logger.warning(
            "collectives not measured: they need %d GPUs on this host (one per rank), %d found; the "
            "cost model prices them from the cluster's link bandwidth",
            run.ranks,
            torch.cuda.device_count(),
        )
    elif run.ranks > 1:
        # attention collectives move a few activations' worth per layer: tens of KB to MBs per rank
        attention = [1 << 16, 1 << 20, 4 << 20]
        # sharded data parallelism gathers and reduces one module's parameters at a time: up to a few layers' worth
        layer_bytes = int(Precision.of(target.dtype).grad * params["layer"])
        sharded = [1 << 20, 4 << 20, max(layer_bytes, 8 << 20)]
        measured = measure_collectives(
            run.ranks,
            {
                "allreduce": [1 << 20, 4 << 20, int(grad_bytes)],
                "allgather": sharded,
                "reducescatter": sharded,
                "alltoall": attention,
                "p2p": attention,
            },
            repeats=grid.repeats,
            threads=run.threads,
            backend=backend,
        )
    samples: list[Sample] = []
    for (layout, lens, rc, depth), job, (fwd, bwd) in zip(keys, jobs, times):
        stored, peak = memory_of(job.model, job.inputs)
        samples.append(
            Sample(
                component="model",
                num_layers=depth,
                layout=layout,
                recompute=rc,
                seq_lens=lens,
                forward_ms=fwd,
                backward_ms=bwd,
                stored_bytes=stored,
                peak_bytes=peak,
                weight_ms=weights.get((layout, tuple(lens), depth)),
            )
        )
        if depth == l1:
            efwd, ebwd = embedding[(layout, tuple(lens))]
            samples.append(
                Sample(
                    component="embedding",
                    layout=layout,
                    recompute=rc,
                    seq_lens=lens,
                    forward_ms=efwd,
                    backward_ms=ebwd,
                    stored_bytes=0.0,
                    peak_bytes=0.0,
                )
            )
    profile = Profile(
        schema=SCHEMA,
        version=VERSION,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        model=ModelInfo(
            name=run.name,
            num_layers=_full_depth(model_cfg),
            hidden_size=ref.config.hidden_size,
            num_heads=ref.config.num_attention_heads,
            num_kv_heads=getattr(ref.config, "num_key_value_heads", None),
            params=params,
            dtype=target.dtype,
            config=model_cfg,
            shape=shape_from_config(hf_config(model_cfg)),
        ),
        device=target.info(),
        pad_multiple=pad,
        grid={k: list(v) if isinstance(v, tuple) else v for k, v in asdict(grid).items()},
        samples=samples,
        tables=fit_tables(samples, pad),
        ranks=run.ranks,
        update=UpdateSamples(
            backend=backend,
            optimizer=optimizer,
            allreduce=measured.get("allreduce", []),
            allgather=measured.get("allgather", []),
            reducescatter=measured.get("reducescatter", []),
        ),
        collectives=CollectiveSamples(backend=backend, alltoall=measured["alltoall"], p2p=measured["p2p"])
        if measured
        else None,
    )
    if held_out:
        profile = profile.model_copy(
            update={"validation": _score(profile, held_out, times[len(jobs) :], grid.recomputes[0])}
        )
    if "none" in grid.recomputes and len(grid.recomputes) > 1:
        profile = profile.model_copy(update={"pyramid": _pyramid_check(profile, model_cfg, grid, target, rng, pad)})
    return profile


def _on(model, target: Target):
    return model.to(device=target.device, dtype=target.torch_dtype)


def _held_out_cases(keys: list, count: int, grid: ProfileGrid, rng: np.random.Generator, pad: int) -> list[dict]:
    """Random micro-batches inside the measured range of each layout, alternating layouts."""
    cases = []
    for i in range(count):
        layout = grid.layouts[i % len(grid.layouts)]
        feats = [features(lens, layout, pad) for lay, lens, _, _ in keys if lay == layout]
        budget = int(max(f.slots for f in feats))
        longest = int(max(f.max_len for f in feats))
        cases.append({"layout": layout, "seq_lens": _random_micro_batch(rng, budget, longest, layout, pad)})
    return cases


def _score(profile: Profile, cases: list[dict], times: list[tuple[float, float]], recompute: Recompute) -> dict:
    cost = cost_model_from_profile(profile)
    for case, (fwd, bwd) in zip(cases, times):
        m = fwd + bwd
        p = cost.micro_batch_cost(case["seq_lens"], layout=case["layout"], recompute=recompute).time_ms
        case.update(measured_ms=round(m, 3), predicted_ms=round(p, 3), error=round(abs(p - m) / m, 4))
    errors = [c["error"] for c in cases]
    return {
        "recompute": recompute,
        "num_layers": profile.model.num_layers,
        "count": len(cases),
        "mape": float(np.mean(errors)),
        "max_ape": float(np.max(errors)),
        "cases": cases,
    }


def _pyramid_check(
    profile: Profile, model_cfg: dict, grid: ProfileGrid, target: Target, rng: np.random.Generator, pad: int
) -> dict:
    """Peak activation memory of one micro-batch through the full-depth model with 0, n/2 and n
    of its n layers checkpointed (through the RecomputeSwitch training uses), against what
    ``evaluate_checkpointed`` predicts from the fitted tables: pyramid plans are priced by
    combining two tables that were each measured whole, and this checks the combination."""
    import torch

    from ..models.hf import build_causal_lm

    mode = "full" if "full" in grid.recomputes else next(r for r in grid.recomputes if r != "none")
    layout = "packed" if "packed" in grid.layouts else grid.layouts[0]
    # the largest measured micro-batch: activations dominate there, and it is inside the fit's range
    seq_len, size = max(grid.points(), key=lambda p: (p[0] * p[1], p[0]))
    lens = micro_batch_lengths(layout, seq_len, size, rng)
    cost = cost_model_from_profile(profile)
    f = features(lens, layout, pad)
    torch.manual_seed(grid.seed)
    model = _on(build_causal_lm(model_cfg).train(), target)
    switch = RecomputeSwitch(model)
    inputs = make_inputs(lens, layout, model.config.vocab_size, pad, rng).to(target.device)
    timed_step(model, inputs)  # gradients allocated once, as in the profile's own memory pass
    depth = len(switch.layers)
    cases = []
    for count in sorted({0, depth // 2, depth}):
        switch.set(mode, count)
        stored, peak = memory_of(model, inputs)
        predicted = evaluate_checkpointed(
            cost.table(layout, mode), cost.table(layout, "none"), f, StageSpec(depth), count
        )
        cases.append(
            {
                "checkpointed": count,
                "measured_peak_bytes": peak,
                "predicted_peak_bytes": predicted.peak_bytes,
                "measured_stored_bytes": stored,
                "predicted_stored_bytes": predicted.stored_bytes,
                "error": round(abs(predicted.peak_bytes - peak) / peak, 4),
            }
        )
    worst = max(c["error"] for c in cases)
    logger.info(
        "pyramid checkpointing check (%s, %d tokens, %s of %d layers checkpointed): peak memory predicted "
        "within %.1f%% of measured",
        mode,
        int(f.slots),
        "/".join(str(c["checkpointed"]) for c in cases),
        depth,
        100 * worst,
    )
    return {
        "recompute": mode,
        "layout": layout,
        "seq_lens": lens,
        "num_layers": depth,
        "max_error": worst,
        "cases": cases,
    }


def _full_depth(cfg: dict) -> int:
    return int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or cfg["num_layers"])


def _param_counts(model, depth: int) -> dict[str, float]:
    layers = decoder_layers(model)
    layer = sum(p.numel() for p in layers[0].parameters())
    embedding = sum(p.numel() for p in model.get_input_embeddings().parameters())
    total = sum(p.numel() for p in model.parameters())
    return {"embedding": float(embedding), "layer": float(layer), "head": float(total - embedding - depth * layer)}


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
