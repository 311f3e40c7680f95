"""Per-document ("varlen") causal attention for packed rows, registered into transformers.

Transformers isolates packed documents by building a dense block-diagonal mask, so attention
still costs (sum s)^2 per row. Flash-attention's varlen kernels cost sum(s_i^2); this kernel
gives CPU (or any device without flash-attn) the same cost structure by running causal SDPA
once per document. It reads document boundaries from ``position_ids`` resets, the same signal
HF's flash-attention path uses, so packed micro-batches need no mask at all.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "dyn_varlen"


def document_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each document in a packed row, from where position ids restart at 0."""
    starts = torch.nonzero(position_ids == 0, as_tuple=False).flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    ends = starts[1:] + [int(position_ids.numel())]
    return list(zip(starts, ends))


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function. query: [b, heads, s, d]; returns [b, s, heads, d]."""
    if attention_mask is not None:
        raise ValueError(
            f"{NAME} attention expects attention_mask=None (padded rows are right-padded and causal, "
            "packed rows carry position_ids resets)"
        )
    position_ids = kwargs.get("position_ids")
    gqa = key.shape[1] != query.shape[1]
    drop = dropout if module.training else 0.0
    rows = []
    for b in range(query.shape[0]):
        q, k, v = query[b : b + 1], key[b : b + 1], value[b : b + 1]
        bounds = [(0, q.shape[2])] if position_ids is None else document_bounds(position_ids[min(b, position_ids.shape[0] - 1)])
        parts = [
            F.scaled_dot_product_attention(
                q[:, :, s:e], k[:, :, s:e], v[:, :, s:e],
                dropout_p=drop, is_causal=True, scale=scaling, enable_gqa=gqa,
            )
            for s, e in bounds
        ]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the kernel with transformers (idempotent); returns its attn_implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)
    return NAME
