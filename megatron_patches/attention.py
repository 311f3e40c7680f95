"""Packed (THD) sequences through megatron-core's local attention, without TransformerEngine.

Variable-length training packs several documents into one row; Megatron then passes
``PackedSeqParams(qkv_format="thd")`` to the core attention, and only TransformerEngine's
``TEDotProductAttention`` accepts it: the local ``DotProductAttention`` asserts it is ``None``. On
CPU (tests, the gloo demo) and wherever TransformerEngine is not installed, packed batches could
therefore not run at all.

``PackedDotProductAttention`` attends within each document only (causal, as each document alone
would), by handing each document's slice to ``DotProductAttention.forward`` itself. Delegating,
rather than reimplementing with ``scaled_dot_product_attention``, keeps every numerical choice of
the local attention (its softmax scale and query-key layer scaling split between the matmul and an
fp32 softmax, the -10000 mask fill, softmax offsets, sliding windows, dropout under the
tensor-parallel RNG tracker): a packed row then equals its documents run one at a time, which is
what the per-document loss and gradient tests compare. The cost is a Python loop over documents and
a host sync for the lengths; attention memory is the sum of the squared document lengths rather
than the squared row length. With TransformerEngine the TE spec is used instead and this patch
changes nothing there.

The subclass is defined against the original class when this module is imported, which is before
the patch can be applied (``attention_patches`` lives here); the patch then rebinds
``DotProductAttention`` in every loaded module that from-imported it (``megatron.core.models.backends``,
which ``get_gpt_layer_local_spec`` reads), so layer specs built after the patch get the subclass. A
module first imported while the patch is on binds the subclass itself and keeps it after a revert:
import the model modules before applying where the revert must be complete (the tests do).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from .registry import Patch

TARGET = "megatron.core.transformer.dot_product_attention.DotProductAttention"


def _offsets(params: PackedSeqParams, kind: str) -> tuple[list[int], list[int]]:
    """Per document: where it starts in the packed row and how many real tokens it has.

    With ``cu_seqlens_*_padded`` (documents padded, e.g. to a multiple of the context-parallel
    size) the row layout follows the padded offsets, as RoPE's THD path does; the tokens past a
    document's real length are padding."""
    real = getattr(params, f"cu_seqlens_{kind}")
    padded = getattr(params, f"cu_seqlens_{kind}_padded")
    if real is None:
        raise ValueError(f"packed THD attention needs PackedSeqParams.cu_seqlens_{kind}")
    real = real.tolist()
    starts = padded.tolist() if padded is not None else real
    if len(starts) != len(real):
        raise ValueError(f"cu_seqlens_{kind} and cu_seqlens_{kind}_padded describe different numbers of documents")
    lengths = [b - a for a, b in zip(real[:-1], real[1:])]
    return starts[:-1], lengths


class PackedDotProductAttention(DotProductAttention):
    """``DotProductAttention`` that also accepts packed THD input (``packed_seq_params``)."""

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """Without ``packed_seq_params``: ``DotProductAttention.forward``. With THD params: query
        ``[t, np, hn]``, key and value ``[t, ng, hn]`` (Megatron's ``Attention`` squeezes the
        dummy batch dimension) give ``[t, np * hn]``, which ``Attention`` reshapes to ``[t, 1, h]``.
        Padding tokens between documents (``cu_seqlens_*_padded``) get a zero output."""
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise NotImplementedError(f"PackedDotProductAttention supports qkv_format 'thd', not "
                                      f"{packed_seq_params.qkv_format!r}")
        if query.dim() != 3:
            raise ValueError(f"THD query must be [tokens, heads, head_dim], got shape {tuple(query.shape)}")
        # attention_mask is not used: as with TransformerEngine's THD path, cu_seqlens and causality are the mask
        q_starts, q_lengths = _offsets(packed_seq_params, "q")
        kv_starts, kv_lengths = _offsets(packed_seq_params, "kv")
        if len(q_lengths) != len(kv_lengths):
            raise ValueError("cu_seqlens_q and cu_seqlens_kv describe different numbers of documents")
        pieces, cursor = [], 0
        for qs, ql, ks, kl in zip(q_starts, q_lengths, kv_starts, kv_lengths):
            if ql == 0:
                continue
            if qs > cursor:  # padding before this document
                pieces.append(query.new_zeros(qs - cursor, self.hidden_size_per_partition))
            # [l, heads, hn] -> [l, b=1, heads, hn]: one document is DotProductAttention's batch of one
            context = super().forward(query[qs:qs + ql].unsqueeze(1), key[ks:ks + kl].unsqueeze(1),
                                      value[ks:ks + kl].unsqueeze(1), None, attn_mask_type=attn_mask_type,
                                      attention_bias=attention_bias)
            pieces.append(context.squeeze(1))
            cursor = qs + ql
        if cursor < query.size(0):
            pieces.append(query.new_zeros(query.size(0) - cursor, self.hidden_size_per_partition))
        return torch.cat(pieces, dim=0)


def _replace(original: Any) -> type:
    if not (isinstance(original, type) and issubclass(PackedDotProductAttention, original)):
        raise TypeError(f"{TARGET} is {original!r}, not the class PackedDotProductAttention was defined against "
                        "(megatron_patches.attention was imported after another patch replaced it)")
    return PackedDotProductAttention


def attention_patches() -> list[Patch]:
    """The patch making ``DotProductAttention`` (and the local layer specs using it) accept THD input."""
    return [Patch("attention.packed_thd", TARGET, _replace, aliases=True)]
