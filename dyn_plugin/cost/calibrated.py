"""Cost models of larger transformers: the analytic model calibrated on the measured A100 tables.

The bundled profile ``a100-gpt-6.7b`` measured one model (GPT 6.7B-class, Megatron-LM, fp16,
A100 40GB) at tensor-parallel degrees 1, 2, 4 and 8 and every recompute mode. Other models are
priced on the same cluster by transferring those measurements through the analytic model
(``cost/analytic.py``, on an A100: 312 TFLOP/s fp16), which knows how each cost term scales
with the model's shape:

- every table is a line per component and metric, ``c0 + c1*tokens + c2*attn`` (cost/table.py);
- the per-token and per-pair terms (c1: linear layers and activations per token; c2: attention
  FLOPs and softmax bytes per query-key pair) of time and memory are scaled by the analytic
  model's ratio between the two shapes, table by table (same layout, recompute mode and tp):
  ``c(shape) = c_measured(reference) * analytic(shape) / analytic(reference)``. What the
  measurement holds beyond the formula carries over as a factor: the kernels' achieved
  throughput, tensor parallelism's inefficiency (its unsharded activations and its smaller
  GEMMs), the memory the framework keeps beyond Korthikanti et al.'s count. The analytic
  model's throughput and per-layer overhead cancel in the ratio: only shapes matter;
- the constant (per micro-batch: kernel launches, fixed buffers) and the floor (the smallest
  time any kernel takes) are the measured ones, unchanged: they do not grow with width;
- parameters per component scale the same way (the measured counts hold Megatron's biases and
  padded vocabulary);
- a term the analytic model gives zero for both shapes keeps its measured value (the formula
  cannot scale what it does not model: e.g. the head's time per pair, the fit's noise); a term
  it gives zero for the reference only (a shape without flash attention calibrated on one with
  it) takes the analytic value, as nothing measured scales it;
- components the tables did not measure stay unmeasured: the embedding and the head's memory
  are zero in the reference (the import's documented assumption), so they are in every
  calibrated model too; tables the reference lacks are not invented, and the measured range
  (``max_tokens``, ``max_len``) and extrapolation rule are the reference's.

The measured layers materialise the softmax (no flash attention): their stored bytes per pair
are 5 per head (169.6 at tp 1 against 5*32 = 160, halving with tp), so the shapes below say
``flash_attention=False`` to be priced on that same stack.

Checks (tests/test_schemes.py): calibrating the reference's own shape reproduces the measured
model exactly (every ratio is 1); Llama 7B and GPT 6.7B differ in time per token by what their
FLOPs differ (the head's vocabulary, the gated MLP), Llama 13B by its larger width and depth.

Any measured reference transfers the same way: ``dynplugin bench families`` (bench/families.py)
prices every family's tiny model from a tiny-Llama profile of the machine, whose shape the
profile records, and holds the prediction out against the family's measured step.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from ..config import DeviceSpec, ModelShape
from .analytic import analytic_cost_model, param_counts
from .bundled import load_bundled
from .profile import cost_model_from_profile
from .table import CostTable, LinearFit, TableCostModel

A100 = DeviceSpec(name="A100", peak_tflops=312.0)  # fp16 dense; cancels in the ratios all the same
REFERENCE = "gpt-6.7b"

MODELS: dict[str, ModelShape] = {
    # the measured model (the DynaPipe artifact's Megatron GPT config)
    "gpt-6.7b": ModelShape(
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        ffn_hidden_size=16384,
        vocab_size=50257,
        gated_mlp=False,
        flash_attention=False,
    ),
    "llama-7b": ModelShape(
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        ffn_hidden_size=11008,
        vocab_size=32000,
        gated_mlp=True,
        flash_attention=False,
    ),
    "llama-13b": ModelShape(
        hidden_size=5120,
        num_layers=40,
        num_heads=40,
        ffn_hidden_size=13824,
        vocab_size=32000,
        gated_mlp=True,
        flash_attention=False,
    ),
    # a 32B-class model: Qwen2.5-32B's shape, chosen over Llama's 30B/33B (52 heads) because its 40 query and
    # 8 key/value heads split over tensor parallelism of 8
    "llama-32b": ModelShape(
        hidden_size=5120,
        num_layers=64,
        num_heads=40,
        num_kv_heads=8,
        ffn_hidden_size=27648,
        vocab_size=152064,
        gated_mlp=True,
        flash_attention=False,
    ),
}


def _scaled(measured: float, shape_term: float, ref_term: float) -> float:
    if ref_term == 0.0:
        # zero for both: nothing to scale by, keep what was measured; zero for the reference only: the formula's own
        return measured if shape_term == 0.0 else shape_term
    return measured * (shape_term / ref_term)  # the ratio first: an exact 1.0 for the reference's own shape


def _calibrated_fit(measured: LinearFit, shape_fit: LinearFit, ref_fit: LinearFit) -> LinearFit:
    return measured.map_terms(
        lambda c: (
            c[0],
            _scaled(c[1], shape_fit.coef[1], ref_fit.coef[1]),
            _scaled(c[2], shape_fit.coef[2], ref_fit.coef[2]),
        )
    )


def calibrated_cost_model(
    shape: ModelShape,
    *,
    reference: TableCostModel | None = None,
    reference_shape: ModelShape = MODELS[REFERENCE],
    dtype: str | None = None,
) -> TableCostModel:
    """``shape`` priced on the reference's hardware and stack (default: the measured A100 tables of
    ``gpt-6.7b``, whose shape is ``reference_shape``; or a profile measured here, whose shape it
    records), in the reference's precision (default) or the other 16-bit one: an A100 runs bf16
    at fp16's rate; see the module docstring for the method."""
    reference = reference if reference is not None else named_cost_model(REFERENCE)
    half = ("fp16", "bf16")
    dtype = dtype or reference.dtype
    if dtype != reference.dtype and not (dtype in half and reference.dtype in half):
        raise ValueError(
            f"dtype {dtype!r}: the reference {reference.name!r} was measured in {reference.dtype}; "
            "other precisions would need their own measurements"
        )
    tps = tuple(sorted({tp for _, _, tp in reference.tables}))
    ours = analytic_cost_model(shape, A100, dtype, tps)
    theirs = analytic_cost_model(reference_shape, A100, dtype, tps)
    tables = {}
    for key, table in reference.tables.items():
        fits = {
            comp: {
                metric: _calibrated_fit(fit, ours.tables[key].fits[comp][like], theirs.tables[key].fits[comp][like])
                for metric, fit in metrics.items()
                # a measured W (weight gradients) scales as the forward's matrix multiplies do
                for like in ["forward_ms" if metric == "weight_ms" else metric]
            }
            for comp, metrics in table.fits.items()
        }
        tables[key] = CostTable(table.layout, table.recompute, table.tp, fits, table.max_tokens, table.max_len)
    ours_params, theirs_params = param_counts(shape), param_counts(reference_shape)
    params = {c: _scaled(n, ours_params[c], theirs_params[c]) for c, n in reference.params.items()}
    return replace(
        reference,
        name=f"{reference.name}~{shape.hidden_size}x{shape.num_layers}",
        num_layers=shape.num_layers,
        tables=tables,
        params=params,
        dtype=dtype,
        hidden_size=shape.hidden_size,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
    )


@functools.lru_cache(maxsize=1)
def _measured() -> TableCostModel:
    shape = MODELS[REFERENCE]
    # a planner extrapolates beyond the tables' 8192 tokens (flagging it); the import does not know the heads
    return replace(
        cost_model_from_profile(load_bundled("a100-gpt-6.7b")),
        allow_extrapolation=True,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_heads,
    )


def named_cost_model(name: str) -> TableCostModel:
    """``gpt-6.7b``: the bundled measured A100 profile; the other ``MODELS``: calibrated on it."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    measured = replace(_measured())  # a copy per caller: its C++ tables are its own
    if name == REFERENCE:
        return measured
    return replace(calibrated_cost_model(MODELS[name], reference=measured), name=f"{name}~{measured.name}")
