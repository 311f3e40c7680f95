"""Cost tables from a model's shape and a device spec, with no measurement.

Time is FLOPs over achieved throughput plus a fixed per-layer overhead. Activation memory
follows Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022): per layer and token, 16-bit activations keep ~(15h + MLP) bytes, where the MLP keeps
3h+4f (GELU) or 2h+8f (gated); without flash attention the softmax inputs/outputs and dropout
mask add 5 bytes per head per query-key pair. Selective recompute drops the attention part,
full recompute keeps only the layer input (2h bytes per token).
"""

from __future__ import annotations

from ..config import DeviceSpec, ModelShape
from .model import LAYOUTS, RECOMPUTES, Precision
from .table import CostTable, LinearFit, TableCostModel

ACT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def _flops_per_token(shape: ModelShape) -> tuple[float, float]:
    """Forward FLOPs of one layer per token (linear layers) and per causal query-key pair."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    kv = h * (shape.num_kv_heads or shape.num_heads) / shape.num_heads
    linear = 2 * h * (h + 2 * kv) + 2 * h * h + 2 * h * f * (3 if shape.gated_mlp else 2)
    # QK^T and AV: 2*h FLOPs each per pair; the causal mask skips half of the pairs.
    attention = 2 * h
    return linear, attention


def param_counts(shape: ModelShape) -> dict[str, float]:
    h, f = shape.hidden_size, shape.ffn_hidden_size
    kv = h * (shape.num_kv_heads or shape.num_heads) / shape.num_heads
    layer = h * (h + 2 * kv) + h * h + h * f * (3 if shape.gated_mlp else 2) + 4 * h
    return {"embedding": shape.vocab_size * h, "layer": layer, "head": shape.vocab_size * h + h}


def analytic_cost_model(
    shape: ModelShape, device: DeviceSpec, dtype: str = "bf16", tps: tuple[int, ...] = (1, 2, 4, 8)
) -> TableCostModel:
    """A cost model for every layout, recompute mode and tensor-parallel degree in ``tps``."""
    Precision.of(dtype)  # validates dtype
    h, f, a = shape.hidden_size, shape.ffn_hidden_size, shape.num_heads
    flops_ms = device.peak_tflops * device.achieved_fraction * 1e9  # FLOPs per millisecond
    lin, att = _flops_per_token(shape)
    scale = ACT_BYTES[dtype] / 2  # the per-token byte counts below are for 16-bit activations
    mlp = (2 * h + 8 * f) if shape.gated_mlp else (3 * h + 4 * f)
    quad = 0.0 if shape.flash_attention else 5.0 * a
    stored_by_mode = {
        "none": ((15 * h + mlp) * scale, quad * scale),
        "selective": ((15 * h + mlp) * scale, 0.0),
        "full": (2 * h * scale, 0.0),
    }
    # Transient while a layer runs: its widest intermediates live at once (MLP up/gate, grads).
    transient = ((2 * f + 2 * h) * ACT_BYTES[dtype], quad * scale)
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
                # the loss's fp32 log-softmax over the vocabulary dominates the head's activations: it
                # is saved for backward, which adds its gradient and the logits' (measured, HF loss on
                # torch's CPU kernels, fp32 and bf16 alike: 4 and 12 bytes per token and vocabulary entry)
                "stored_bytes": LinearFit((0.0, 4 * shape.vocab_size / tp, 0.0)),
                "peak_bytes": LinearFit((0.0, 12 * shape.vocab_size / tp, 0.0)),
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
