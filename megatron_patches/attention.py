"""Megatron's local core attention with the kernels the plugin's profile measures, and packed rows.

Variable-length training packs several documents into one row; Megatron then passes
``PackedSeqParams(qkv_format="thd")`` to the core attention, and only TransformerEngine's
``TEDotProductAttention`` accepts it: the local ``DotProductAttention`` asserts it is ``None``. On
CPU (tests, the gloo demo) and wherever TransformerEngine is not installed, packed batches could
therefore not run at all.

``PackedDotProductAttention`` attends within each document only (causal, as each document alone
would). Where the attention is plain causal softmax attention (no bias, no softmax offset, no
sliding window, no mask beyond causality, no active dropout: the common case and the tests'), it
runs torch's ``scaled_dot_product_attention``, per document for packed rows: the kernels the
plugin's profiler measures on the transformers model (``sdpa``, and the per-document varlen path
of ``dyn_plugin/models/varlen_attention.py``), so the profile prices what Megatron runs; on CUDA in
half precision a packed row is that path's one call of torch's flash varlen kernel, the boundaries
left on the device and the longest document read from ``PackedSeqParams`` (a host int), so nothing
is read back per layer or per micro-batch. The local class instead materialises the full score matrix with an unfused softmax, which on CPU made a
4096-token layer 3.6x slower than the profile and the step predictions 4x too short. Anything else
is delegated to ``DotProductAttention.forward`` itself (per document for packed rows), keeping
every numerical choice of the local attention (query-key layer scaling, the -10000 mask fill,
softmax offsets, sliding windows, dropout under the tensor-parallel RNG tracker). Elsewhere packed rows
cost a Python loop over documents and one read of the lengths per micro-batch; attention memory is the sum of the
squared document lengths rather than the squared row length. With TransformerEngine the TE spec is
used instead and this patch changes nothing there. Inside a sequence-parallel shard the attention
spans the shard's group (``megatron_patches.sequence_parallel``).

The subclass is defined against the original class when this module is imported, which is before
the patch can be applied (``attention_patches`` lives here); the patch then rebinds
``DotProductAttention`` in every loaded module that from-imported it (``megatron.core.models.backends``,
which ``get_gpt_layer_local_spec`` reads), so layer specs built after the patch get the subclass.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from dyn_plugin.models import sequence_parallel, varlen_attention
from dyn_plugin.models.varlen_attention import document_attention

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
    real = _bounds(real, f"cu_seqlens_{kind}")
    starts = _bounds(padded, f"cu_seqlens_{kind}_padded") if padded is not None else real
    if len(starts) != len(real):
        raise ValueError(f"cu_seqlens_{kind} and cu_seqlens_{kind}_padded describe different numbers of documents")
    lengths = [b - a for a, b in zip(real[:-1], real[1:])]
    return starts[:-1], lengths


# Every layer of a micro-batch's forward (and its recompute) gets the same boundaries tensor: it is
# read back once per micro-batch rather than once per layer (each read is a device sync on GPU).
_READ: dict[int, list[int]] = {}


def _bounds(cu: Tensor, name: str) -> list[int]:
    """The document boundaries of one packed row: ``[n + 1]``, or ``[1, n + 1]`` as Megatron-LM's
    packed batches carry them (micro-batch size 1: ``get_batch_on_this_tp_rank`` asserts it, and
    ``get_thd_batch_on_this_cp_rank`` passes the tensor on unsqueezed). Any other shape is refused:
    read as a list of rows it would describe no document, and the attention would be all zeros."""
    known = _READ.get(id(cu))
    if known is not None:
        return known
    bounds = _read_bounds(cu, name)
    _READ[id(cu)] = bounds
    weakref.finalize(cu, _READ.pop, id(cu), None)  # gone before its id can be reused
    return bounds


def _read_bounds(cu: Tensor, name: str) -> list[int]:
    if cu.dim() == 2 and cu.size(0) == 1:
        cu = cu[0]
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"PackedSeqParams.{name} must be the boundaries of one packed row, shaped [n + 1] or [1, n + 1] "
            f"(n documents, n >= 1), got shape {tuple(cu.shape)}"
        )
    bounds = [int(b) for b in cu.tolist()]
    if bounds[0] != 0 or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"PackedSeqParams.{name} must start at 0 and never decrease, got {bounds}")
    return bounds


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
        Padding tokens between documents (``cu_seqlens_*_padded``) get a zero output. Inside a
        sequence-parallel shard (``megatron_patches.sequence_parallel``) the attention spans the
        shard's group."""
        shard = sequence_parallel.current()
        if shard is not None:
            return self._over_group(
                shard, query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        if packed_seq_params is None:
            return self._attend(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise NotImplementedError(
                f"PackedDotProductAttention supports qkv_format 'thd', not {packed_seq_params.qkv_format!r}"
            )
        if query.dim() != 3:
            raise ValueError(f"THD query must be [tokens, heads, head_dim], got shape {tuple(query.shape)}")
        if self._one_call(query, key, attention_mask, attn_mask_type, attention_bias, packed_seq_params):
            # the boundaries stay on the device and the longest document comes as a host int: no sync
            cu = _row(packed_seq_params.cu_seqlens_q)
            out = varlen_attention.flash_call(query, key, value, cu, packed_seq_params.max_seqlen_q, self._scale())
            return out.reshape(query.size(0), self.hidden_size_per_partition)
        # attention_mask is not used: as with TransformerEngine's THD path, cu_seqlens and causality are the mask
        q_starts, q_lengths = _offsets(packed_seq_params, "q")
        kv_starts, kv_lengths = _offsets(packed_seq_params, "kv")
        if len(q_lengths) != len(kv_lengths):
            raise ValueError("cu_seqlens_q and cu_seqlens_kv describe different numbers of documents")
        end = q_starts[-1] + q_lengths[-1]
        if end > query.size(0) or kv_starts[-1] + kv_lengths[-1] > key.size(0):
            raise ValueError(
                f"cu_seqlens describe {end} tokens but the packed row holds {query.size(0)} queries and "
                f"{key.size(0)} keys"
            )
        if sum(q_lengths) == 0 and query.size(0) > 0:
            raise ValueError(f"cu_seqlens describe no token of the packed row of {query.size(0)} tokens")
        pieces, cursor = [], 0
        for qs, ql, ks, kl in zip(q_starts, q_lengths, kv_starts, kv_lengths):
            if ql == 0:
                continue
            if qs > cursor:  # padding before this document
                pieces.append(query.new_zeros(qs - cursor, self.hidden_size_per_partition))
            # [l, heads, hn] -> [l, b=1, heads, hn]: one document is DotProductAttention's batch of one
            context = self._attend(
                query[qs : qs + ql].unsqueeze(1),
                key[ks : ks + kl].unsqueeze(1),
                value[ks : ks + kl].unsqueeze(1),
                None,
                attn_mask_type,
                attention_bias,
            )
            pieces.append(context.squeeze(1))
            cursor = qs + ql
        if cursor < query.size(0):
            pieces.append(query.new_zeros(query.size(0) - cursor, self.hidden_size_per_partition))
        return torch.cat(pieces, dim=0)

    def _over_group(
        self,
        shard: sequence_parallel.SequenceShard,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType],
        attention_bias: Optional[Tensor],
        packed_seq_params: Optional[PackedSeqParams],
    ) -> Tensor:
        """[s/k, b, heads, hn] of this rank's shard -> [s/k, b, heads * hn]: per-document causal
        attention over the whole rows, through the plugin's Ulysses or ring attention."""
        if packed_seq_params is not None or not self._plain(attention_mask, attn_mask_type, attention_bias):
            raise ValueError(
                "a sequence-parallel micro-batch reached a core attention that is not plain causal softmax "
                "attention over plain rows (packed parameters, a mask or bias, a softmax offset, a sliding window "
                "or attention dropout): the plugin's group attention computes only that; turn those off or "
                "set dyn_plugin.sequence_parallel.enabled to false"
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s/k, hn]
        out = sequence_parallel.attention(shard, q, k, v, document_attention, 0.0, self._scale())
        s, b = query.size(0), query.size(1)
        return out.permute(1, 0, 2, 3).reshape(s, b, self.hidden_size_per_partition)

    def _plain(
        self, attention_mask: Optional[Tensor], attn_mask_type: Optional[AttnMaskType], attention_bias: Optional[Tensor]
    ) -> bool:
        """Plain causal softmax attention: what torch's SDPA (and the plugin's kernels) compute."""
        return (
            attention_mask is None
            and attention_bias is None
            and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
            and self.softmax_offset is None
            and self.scale_mask_softmax.window_size is None
            and (self.attention_dropout.p == 0 or not self.training)
        )

    def _one_call(
        self,
        query: Tensor,
        key: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType],
        attention_bias: Optional[Tensor],
        params: PackedSeqParams,
    ) -> bool:
        """Whether torch's flash varlen kernel computes this packed call in one launch, exactly as the
        per-document loop would: plain causal attention on CUDA in half precision, the same boundaries
        for queries and keys with no padding between documents, and the longest document known on
        the host (Megatron-LM's ``get_thd_batch_on_this_cp_rank`` and :func:`packed_seq_params` set it).
        Identity, not equality, of the boundary tensors: comparing them would read the device."""
        return (
            varlen_attention.flash_device(query)
            and varlen_attention.flash_exact(query, key, 0.0, None, None)
            and self._plain(attention_mask, attn_mask_type, attention_bias)
            and params.cu_seqlens_kv is params.cu_seqlens_q
            and params.cu_seqlens_q_padded is None
            and params.cu_seqlens_kv_padded is None
            and isinstance(params.max_seqlen_q, int)
            and params.max_seqlen_kv == params.max_seqlen_q
        )

    def _scale(self) -> float:
        # the local class splits the scale between the matmul and an fp32 softmax; the product is this
        return self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)

    def _attend(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType],
        attention_bias: Optional[Tensor],
    ) -> Tensor:
        """[s, b, heads, hn] -> [s, b, heads * hn]: SDPA where it computes the same, else the local class."""
        if not self._plain(attention_mask, attn_mask_type, attention_bias):
            return super().forward(
                query, key, value, attention_mask, attn_mask_type=attn_mask_type, attention_bias=attention_bias
            )
        scale = self._scale()
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=k.size(1) != q.size(1)
        )
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)


def _replace(original: Any) -> type:
    if not (isinstance(original, type) and issubclass(PackedDotProductAttention, original)):
        raise TypeError(
            f"{TARGET} is {original!r}, not the class PackedDotProductAttention was defined against "
            "(megatron_patches.attention was imported after another patch replaced it)"
        )
    return PackedDotProductAttention


THD_BATCH = "megatron.core.utils.get_thd_batch_on_this_cp_rank"


def _row(cu: Optional[Tensor]) -> Optional[Tensor]:
    return cu[0] if cu is not None and cu.dim() == 2 and cu.size(0) == 1 else cu


def _thd_batch(original: Any) -> Any:
    """Megatron-LM's ``get_batch`` hands its packed batch's ``cu_seqlens`` (``[1, n + 1]``) to
    ``get_thd_batch_on_this_cp_rank``, which puts it into ``PackedSeqParams`` as it is; megatron-core's
    THD consumers (RoPE's ``_apply_rotary_pos_emb_thd``, TransformerEngine) read ``[n + 1]``, so the row
    is taken out of the batch dimension first."""

    @functools.wraps(original)
    def get_thd_batch_on_this_cp_rank(batch, cu_seqlens, cu_seqlens_padded, max_seqlen, *args, **kwargs):
        return original(batch, _row(cu_seqlens), _row(cu_seqlens_padded), max_seqlen, *args, **kwargs)

    return get_thd_batch_on_this_cp_rank


def attention_patches() -> list[Patch]:
    """The patch making ``DotProductAttention`` (and the local layer specs using it) accept THD input,
    and Megatron-LM's packed batch boundaries given to it as one row."""
    return [
        Patch("attention.packed_thd", TARGET, _replace, aliases=True),
        Patch("attention.thd_batch", THD_BATCH, _thd_batch),
    ]
