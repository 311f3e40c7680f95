"""A plan's peak memory per GPU, by the cost model and by the measured tables: what the plan
evaluations (``bench sp``, ``bench strategy``, ``bench shard``) report beside time.

The cost model prices activations by its fit of the measured A100 tables; the tables themselves
(``cost/table_memory.py``, read without a fit) price the same micro-batches on the same
schedules independently, so a fit that bends away from the measurements shows as a plan that
fits by its own estimate and not by the tables.
"""

from __future__ import annotations

from dataclasses import replace

from ..cost.bundled import MEASURED_DIR
from ..cost.model import features
from ..cost.table_memory import MeasuredLayerMemory
from ..plan.steps.pricing import sp_buffer_bytes
from ..plan.steps.simulator import stage_peak_bytes
from ..plan.steps.spec import PlannerSpec
from ..plan.steps.types import MicroBatch, StepPlan

MB = 1 << 20
# the measured tables a model's layers can be priced by independently of the cost model's fit
TABLES = {"gpt-6.7b": MEASURED_DIR / "a100-gpt-6.7b.json"}


def measured_tables(model: str) -> MeasuredLayerMemory | None:
    """The measured tables of a bench model, None where it has none."""
    return MeasuredLayerMemory(TABLES[model]) if model in TABLES else None


def memory_record(
    plans: list[StepPlan],
    specs: dict[tuple[int, int, int], PlannerSpec],
    limit_bytes: float,
    tables: MeasuredLayerMemory | None = None,
) -> dict:
    """Peak memory per GPU over the steps' plans. ``peak_mem_mb``: by the cost model's memory (the
    per-length fit of the measured tables): each stage's simulated activation peak (every
    micro-batch in flight under its schedule, plus the transient of the one running) plus the model
    states its spec charges (``StageMemory.states``). ``peak_mem_mb_tables`` (with ``tables``): the same schedules with
    every micro-batch's transformer layers read off the measured tables instead
    (``table_micro_batch``); ``beyond_tables_mbs`` counts micro-batches with a row longer than the
    tables measured (extrapolated there, not measured).
    ``specs`` maps a pipeline's (tp, pp, sp) to its spec. ``fits`` / ``fits_tables``: no rank of any
    step exceeds ``limit_bytes``; ``extrapolated_mbs``: micro-batches the cost model priced beyond
    its measured lengths."""
    limit = limit_bytes
    peak, by_tables, extrapolated, beyond = 0.0, 0.0, 0, 0
    for plan in plans:
        extrapolated += plan.extrapolated
        for rep in plan.replicas:
            spec = specs[(rep.tp, len(rep.schedule.stages), rep.size)]
            states = [mem.states for mem in spec.memory]
            for act, st in zip(rep.sim.peak_bytes, states):
                peak = max(peak, act + st)
            if tables is None:
                continue
            priced = []
            for mb in rep.micro_batches:
                mb2, out = table_micro_batch(mb, spec, tables)
                priced.append(mb2)
                beyond += out
            for stage, st in enumerate(states):
                by_tables = max(by_tables, stage_peak_bytes(priced, rep.schedule.stages[stage], stage) + st)
    out = {
        "peak_mem_mb": peak / MB,
        "memory_limit_mb": limit / MB,
        "fits": bool(peak <= limit * (1 + 1e-9)),
        "extrapolated_mbs": extrapolated,
    }
    if tables is not None:
        out.update(
            peak_mem_mb_tables=by_tables / MB,
            fits_tables=bool(by_tables <= limit * (1 + 1e-9)),
            beyond_tables_mbs=beyond,
        )
    return out


def table_micro_batch(mb: MicroBatch, spec: PlannerSpec, tables: MeasuredLayerMemory) -> tuple[MicroBatch, int]:
    """``mb`` with its per-stage stored and peak bytes priced by the measured tables: each layer of
    a stage holds, per rank, 1/sp of what the tables measured for its rows (a padded micro-batch's
    rows at their padded width, a packed one's documents): a group's ranks hold 1/sp of every
    row's tokens, and under Ulysses 1/sp of the heads over the whole row (the tables' attention
    matrices, quadratic in the row's length, divide by sp, not by sp^2). Its checkpointed layers
    under its recompute mode, the others under none; the embedding's and head's from the cost
    model (the tables did not measure them); the peak adds the largest in-flight extra of any one
    of them, and under sequence parallelism the executor's buffers as ``plan/steps/pricing.py`` prices
    them (the tables ran without). Returns (micro-batch, 1 if some row was longer than the tables
    measured (extrapolated, ``MeasuredLayerMemory.sequence``), else 0)."""
    rows = [mb.shape[1]] * mb.shape[0] if mb.layout == "padded" else [int(s) for s in mb.seq_lens]
    beyond = int(max(rows) > tables.longest("none", spec.tp))

    def layer(rc: str) -> tuple[float, float]:
        stored, extra = tables.micro_batch(rows, rc, spec.tp)
        return stored / mb.sp, extra / mb.sp

    fits = spec.cost.table(mb.layout, mb.recompute, spec.tp).fits
    f = features(mb.seq_lens, mb.layout, spec.cost.pad_multiple, mb.sp)
    ckpt, none = layer(mb.recompute), layer("none")
    stored_by, peak_by = [], []
    for i, stage in enumerate(spec.stages):
        n = stage.num_layers
        k = mb.checkpointed[i] if mb.checkpointed else (n if mb.recompute != "none" else 0)
        stored = k * ckpt[0] + (n - k) * none[0]
        extra = max(ckpt[1] if k else 0.0, none[1] if k < n else 0.0)
        for comp, on in (("embedding", stage.first), ("head", stage.last)):
            if on:
                s = fits[comp]["stored_bytes"](f)
                stored += s
                extra = max(extra, fits[comp]["peak_bytes"](f) - s)
        # the executor's buffers, as the planner prices them (the tables ran no sequence parallelism)
        kept, transient = sp_buffer_bytes(spec, mb.sp, mb.recompute, f, n, k)
        stored_by.append(stored + kept)
        peak_by.append(stored + max(extra, 0.0) + kept + transient)
    return replace(mb, stored_bytes=tuple(stored_by), peak_bytes=tuple(peak_by)), beyond
