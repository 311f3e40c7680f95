"""Cost tables from a model's shape and a device spec, with no measurement.

Time is FLOPs over achieved throughput plus a fixed per-layer overhead. Activation memory
follows Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022): per layer and token, 16-bit activations keep ~(15h + MLP) bytes, where the MLP keeps
3h+4f (GELU) or 2h+8f (gated); without flash attention the softmax inputs/outputs and dropout
mask add 5 bytes per head per query-key pair. Selective recompute drops the attention part,
full recompute keeps only the layer input (2h bytes per token).

The shape's own widths enter where the model computes with them (``config.ModelShape``,
read from a transformers config by ``shape.py``): the queries and the attention's output are
heads x head_dim wide (not h where head_dim is set apart from it, as Gemma's is), keys and values
kv_heads x head_dim; a mixture of experts runs each token through its router (h x experts), its
active experts and its shared ones, each an MLP of its own width, and keeps each one's
activations; a model of dense and sparse layers is priced at their mean layer (per-layer tables
hold one layer). A tied head holds no weights of its own.
"""

from __future__ import annotations

from ..config import DeviceSpec, ModelShape
from .model import HF_LOSS_BYTES, LAYOUTS, RECOMPUTES, Precision
from .table import CostTable, LinearFit, TableCostModel

ACT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def _active_widths(shape: ModelShape) -> list[int]:
    """Inner widths of the MLPs a token runs through in a layer: one dense MLP, or in a sparse
    layer of a mixture of experts its active routed experts and the shared ones."""
    if not shape.num_experts:
        return [shape.ffn_hidden_size]
    routed = [shape.expert_ffn_hidden_size or shape.ffn_hidden_size] * shape.experts_per_token
    return routed + ([shape.shared_expert_ffn_hidden_size] if shape.shared_expert_ffn_hidden_size else [])


def _per_layer(shape: ModelShape, sparse: float, dense: float) -> float:
    """A quantity of one layer: of the dense MLP's, or the mean over a mixture of experts' sparse
    and dense layers (the tables price one layer, repeated)."""
    if not shape.num_experts:
        return dense
    d = shape.dense_layers
    return ((shape.num_layers - d) * sparse + d * dense) / shape.num_layers


def layer_flops_per_token(shape: ModelShape) -> tuple[float, float]:
    """Forward FLOPs of one layer per token (linear layers) and per causal query-key pair."""
    h, f, q, kv = shape.hidden_size, shape.ffn_hidden_size, shape.query_width, shape.kv_width
    mult = 3 if shape.gated_mlp else 2  # matrices per MLP: (gate,) up, down
    # a sparse layer: the router's logits, then every MLP the token runs through
    sparse = 2 * h * shape.num_experts + sum(2 * h * w * mult for w in _active_widths(shape))
    linear = 2 * h * (q + 2 * kv) + 2 * q * h + _per_layer(shape, sparse, 2 * h * f * mult)
    # QK^T and AV: 2*q FLOPs each per pair; the causal mask skips half of the pairs.
    attention = 2 * q
    return linear, attention


def param_counts(shape: ModelShape) -> dict[str, float]:
    h, f, q, kv = shape.hidden_size, shape.ffn_hidden_size, shape.query_width, shape.kv_width
    mult = 3 if shape.gated_mlp else 2
    # a sparse layer holds the router and every routed expert, not only the active ones
    experts = shape.num_experts * (shape.expert_ffn_hidden_size or f) + shape.shared_expert_ffn_hidden_size
    sparse = h * shape.num_experts + h * experts * mult
    layer = h * (q + 2 * kv) + q * h + _per_layer(shape, sparse, h * f * mult) + 4 * h
    # a tied head computes with the embedding's weights: it holds only the final norm (as the profiler counts it)
    head = h + (0 if shape.tied_embeddings else shape.vocab_size * h)
    return {"embedding": shape.vocab_size * h, "layer": layer, "head": head}


def analytic_cost_model(
    shape: ModelShape, device: DeviceSpec, dtype: str = "bf16", tps: tuple[int, ...] = (1, 2, 4, 8)
) -> TableCostModel:
    """A cost model for every layout, recompute mode and tensor-parallel degree in ``tps``."""
    Precision.of(dtype)  # validates dtype
    h, a = shape.hidden_size, shape.num_heads
    flops_ms = device.peak_tflops * device.achieved_fraction * 1e9  # FLOPs per millisecond
    lin, att = layer_flops_per_token(shape)
    scale = ACT_BYTES[dtype] / 2  # the per-token byte counts below are for 16-bit activations

    def kept(widths: list[int]) -> float:  # each MLP a token runs through keeps its own input and intermediates
        return sum((2 * h + 8 * w) if shape.gated_mlp else (3 * h + 4 * w) for w in widths)

    mlp = _per_layer(shape, kept(_active_widths(shape)), kept([shape.ffn_hidden_size]))
    # Korthikanti's 15h: the layer's input and the attention's output projection input (2h each, here
    # 2h + 2q), Q, K and V (2h each, here 2q each: transformers repeats K and V to every query head before
    # the kernel, and backward keeps those copies), the dropout mask (h) and two norms' inputs (4h)
    token = 7 * h + 8 * shape.query_width + mlp
    quad = 0.0 if shape.flash_attention else 5.0 * a
    stored_by_mode = {
        "none": (token * scale, quad * scale),
        "selective": (token * scale, 0.0),
        "full": (2 * h * scale, 0.0),
    }
    # Transient while a layer runs: its widest intermediates live at once (MLP up/gate, grads).
    widest = _per_layer(shape, sum(_active_widths(shape)), shape.ffn_hidden_size)
    transient = ((2 * widest + 2 * h) * ACT_BYTES[dtype], quad * scale)
    ovh = device.layer_overhead_ms
    head_flops = 2 * h * shape.vocab_size

    tables = {}
    for tp in tps:
        for recompute in RECOMPUTES:
            extra_fwd = {"none": (0.0, 0.0), "selective": (0.0, att), "full": (lin, att)}[recompute]
            tok, pair = stored_by_mode[recompute]
            layer = {
                "forward_ms": LinearFit((ovh, lin / tp / flops_ms, att / tp / flops_ms)),
                "backward_ms": LinearFit(
                    (2 * ovh, (2 * lin + extra_fwd[0]) / tp / flops_ms, (2 * att + extra_fwd[1]) / tp / flops_ms)
                ),
                "stored_bytes": LinearFit((0.0, tok / tp, pair / tp)),
                "peak_bytes": LinearFit((0.0, (tok + transient[0]) / tp, (pair + transient[1]) / tp)),
            }
            head = {
                "forward_ms": LinearFit((ovh, head_flops / tp / flops_ms, 0.0)),
                "backward_ms": LinearFit((2 * ovh, 2 * head_flops / tp / flops_ms, 0.0)),
                # the loss's fp32 log-softmax over the vocabulary dominates the head's activations
                "stored_bytes": LinearFit((0.0, HF_LOSS_BYTES[0] * shape.vocab_size / tp, 0.0)),
                "peak_bytes": LinearFit((0.0, HF_LOSS_BYTES[1] * shape.vocab_size / tp, 0.0)),
            }
            embedding = {
                "forward_ms": LinearFit((ovh, 0.0, 0.0)),
                "backward_ms": LinearFit((ovh, 0.0, 0.0)),
                "stored_bytes": LinearFit((0.0, 0.0, 0.0)),
                "peak_bytes": LinearFit((0.0, h * ACT_BYTES[dtype], 0.0)),
            }
            fits = {"embedding": embedding, "layer": layer, "head": head}
            for layout in LAYOUTS:
                tables[(layout, recompute, tp)] = CostTable(layout, recompute, tp, fits)
    return TableCostModel(
        name=f"analytic:{device.name}",
        num_layers=shape.num_layers,
        tables=tables,
        params=param_counts(shape),
        dtype=dtype,
        allow_extrapolation=True,  # a formula has no measured range to leave
        hidden_size=shape.hidden_size,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
    )
