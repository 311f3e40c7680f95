"""RoPE of packed (THD) rows with the boundaries left on the device.

megatron-core's unfused THD RoPE (``rope_utils._apply_rotary_pos_emb_thd``, what runs without
TransformerEngine's fused kernel, and on CPU) splits the row per document with
``cu_seqlens.tolist()`` and, where the table covers the whole row, reads each document's start with
``.item()``: on a GPU that is a device sync per layer per micro-batch, two for every document.

Without context parallelism every token's rotation is a row of the table:

- its position inside its document (Megatron's usual case: the table has ``max_seqlen`` rows and
  each document takes rows ``0 .. length - 1``), gathered on the device by ``index_select``;
- or, where the table has exactly one row per token of the packed row (Megatron's "exact mapping"
  case, which it recognises by that size), its position in the row: the table itself.

Both give the same frequency rows, in the same order, as Megatron's ``torch.cat`` of slices, then
the same ``_apply_rotary_pos_emb_bshd``: the result is bit for bit Megatron's. With a
context-parallel group of two or more ranks (each rank holds two chunks of every document) and
without a group Megatron's own function runs.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from megatron.core.models.common.embeddings import rope_utils
from torch import Tensor

from .registry import Patch

TARGET = "megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_thd"


def positions_in_documents(cu_seqlens: Tensor, tokens: int) -> Tensor:
    """[tokens] int64: each token's position inside its document, from the documents' boundaries
    (``[n + 1]``, starting at 0, ending at ``tokens``), computed on their device without reading them."""
    index = torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    document = torch.searchsorted(cu_seqlens, index, right=True) - 1
    return (index - cu_seqlens[document]).long()


def _thd_rope(original: Callable[..., Tensor]) -> Callable[..., Tensor]:
    @functools.wraps(original)
    def _apply_rotary_pos_emb_thd(
        t: Tensor,
        cu_seqlens: Tensor,
        freqs: Tensor,
        rotary_interleaved: bool = False,
        multi_latent_attention: bool = False,
        mscale: float = 1.0,
        cp_group: Any = None,
    ) -> Tensor:
        if cp_group is None or cp_group.size() != 1:
            return original(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
        # Megatron's torch.split needs the documents to cover the row, so cu_seqlens[-1] == t.size(0)
        # and its test of the table's size against cu_seqlens[-1] is this host comparison
        if freqs.dim() >= 1 and freqs.size(0) == t.size(0):
            packed = freqs
        else:
            packed = freqs.index_select(0, positions_in_documents(cu_seqlens, t.size(0)))
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1),
            packed,
            rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention,
            mscale=mscale,
        ).squeeze(1)

    return _apply_rotary_pos_emb_thd


def rope_patches() -> list[Patch]:
    """Megatron's unfused THD RoPE without host reads of the boundaries (no context parallelism)."""
    return [Patch("rope.thd_on_device", TARGET, _thd_rope)]
