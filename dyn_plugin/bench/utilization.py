"""What a measured training step achieved on a GPU: model FLOPs utilisation, and its peak memory
beside the plan's prediction.

Model FLOPs count the work the model needs for the step's real tokens, whatever a batching spends
on padding or on attention across documents, so every batching of the same data is scored against
the same work. They follow torchtitan's count, so that its published utilisation (33-39% for
Llama-3.1-8B on one H100 in bf16) compares: per token, 6 FLOPs per weight it multiplies (forward and
backward; the active experts of a mixture, the output head whether tied or not) plus
``12 * layers * query width * t``, where torchtitan's t is the row length and here the token's own
document's length (a packed document attends to itself only). Recompute is not counted: it is
work the hardware does, not work the model needs.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..cost.analytic import layer_flops_per_token
from ..cost.shape import ModelShape

# Dense (no sparsity) peak TFLOP/s of each GPU in bf16 and fp16, from NVIDIA's data sheets (SXM parts).
DENSE_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}


def model_flops(shape: ModelShape, document_lengths: Iterable[int]) -> float:
    """Model FLOPs of training one step on documents of these lengths (see the module's text)."""
    lengths = [int(n) for n in document_lengths]
    linear, _ = layer_flops_per_token(shape)  # one layer's forward: 2 FLOPs per weight per token
    per_token = 3 * shape.num_layers * linear + 6 * shape.vocab_size * shape.hidden_size
    attention = 12 * shape.num_layers * shape.query_width * sum(n * n for n in lengths)
    return per_token * sum(lengths) + attention


def peak_tflops(device: torch.device, dtype: str) -> float | None:
    """The GPU's dense peak in ``dtype`` (bf16 or fp16), None where it is not known here (CPUs, other
    GPUs, fp32: TF32 or not is the kernels' choice)."""
    if device.type != "cuda" or dtype not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for gpu, tflops in DENSE_TFLOPS.items() if gpu in name), None)


def mfu(flops: float, ms: float, ranks: int, tflops: float | None) -> float | None:
    """Model FLOPs utilisation of ``ranks`` GPUs that did ``flops`` in ``ms``."""
    return None if tflops is None else flops / (ms / 1e3) / (ranks * tflops * 1e12)


def start_peak(device: torch.device) -> None:
    """Start measuring the device's peak allocated memory (CUDA; nothing elsewhere)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def measured_peak_mb(device: torch.device) -> float | None:
    """The device's peak allocated memory since ``start_peak``, in MiB (None off CUDA)."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
