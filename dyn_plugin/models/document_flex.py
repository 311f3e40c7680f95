"""Soft-capped causal attention over packed documents in one kernel call: torch's ``flex_attention``.

Gemma2 soft-caps its attention logits (``tanh(score / softcap) * softcap`` before the mask), which
torch's flash varlen kernel cannot do; without this a soft-capped model ran one SDPA-sized loop
iteration per document per layer on CUDA. ``flex_attention`` applies the cap as a score modifier
inside one fused kernel (compiled: torch's eager flex materialises the whole score matrix) and
skips the key blocks its block mask leaves out.

The block mask is built from the documents' boundaries on the device, without a dense
``[tokens, tokens]`` mask (``create_block_mask`` would materialise one) and without reading them
back: each block of :data:`BLOCK` queries visits the key blocks from the one holding the start of its
first query's document (or its window's first key, if later) to its own; inside them the mask
function decides each pair (same document, causal, within the window). Every visited block is
treated as partial, so the mask function alone says which pairs attend: the block list only skips
work. Each forward builds one mask per window (Gemma2 alternates a local and a global layer) and
every layer reuses it.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .per_forward import PerForward

BLOCK = 128  # flex_attention's default sparse block: queries and keys per block

_compiled: Callable | None = None


def kernel() -> Callable:
    """``flex_attention`` compiled (once per process; torch recompiles for new shapes as it needs)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention)
    return _compiled


def document_block_mask(cu: torch.Tensor, tokens: int, window: int | None) -> BlockMask:
    """The block mask of causal attention within each document bounded by ``cu`` (int32 ``[n + 1]``
    over ``tokens`` flattened tokens, on the device) and, with ``window``, of keys fewer than
    ``window`` positions back."""
    device = cu.device
    blocks = (tokens + BLOCK - 1) // BLOCK
    row = torch.arange(blocks, device=device)
    first = row * BLOCK  # each query block's first query
    start = cu[torch.searchsorted(cu, first.to(cu.dtype), right=True) - 1].long()
    if window is not None:
        start = torch.maximum(start, (first - window + 1).clamp(min=0))
    lowest = start // BLOCK
    visited = (row - lowest + 1).to(torch.int32)
    # key blocks lowest..row in order; entries past `visited` are ignored
    indices = (lowest[:, None] + row[None, :]).clamp(max=blocks - 1).to(torch.int32)
    token = torch.arange(tokens, device=device, dtype=cu.dtype)
    document = torch.searchsorted(cu, token, right=True)

    def mask_mod(b, h, q, k):
        seen = (document[q] == document[k]) & (k <= q)
        return seen if window is None else seen & (q - k < window)

    return BlockMask.from_kv_blocks(
        visited[None, None], indices[None, None], BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(tokens, tokens)
    )


_masks = PerForward()  # one block mask per window per forward, reused by every layer


def flex_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    scaling: float | None,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """query [tokens, heads, d], key/value [tokens, kv_heads, d] -> [tokens, heads, d]: causal attention
    within each document ``cu`` bounds (on the device), logits soft-capped at ``softcap``, in one call."""
    tokens = query.shape[0]
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))  # [1, heads, tokens, d]

    def capped(score, b, h, q_idx, k_idx):
        return score if softcap is None else torch.tanh(score / softcap) * softcap

    out = kernel()(
        q,
        k,
        v,
        score_mod=capped,
        block_mask=_masks.get(cu, (tokens, window), lambda: document_block_mask(cu, tokens, window)),
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out[0].transpose(0, 1)
