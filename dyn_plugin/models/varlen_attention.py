"""Per-document ("varlen") causal attention for packed rows, registered into transformers.

Transformers isolates packed documents by building a dense block-diagonal mask, so attention
still costs (sum s)^2 per row. Flash-attention's varlen kernels cost sum(s_i^2); on CUDA (half
precision) this kernel calls torch's flash varlen attention over all documents at once, grouped
query attention and sliding windows included; elsewhere it gets the same cost structure by running
causal SDPA once per document (on a GPU that loop is launch-bound: two kernels per document per
layer). It reads document boundaries from ``position_ids`` resets, the same signal HF's
flash-attention path uses, so packed micro-batches need no mask at all.

Models that attend within a sliding window (Mistral, Qwen2's windowed layers, Gemma2/3's local
layers) or soft-cap their attention logits (Gemma2) pass ``sliding_window`` and ``softcap`` with
every call; the kernel computes exactly what transformers' eager attention does with them (a key
is seen if ``query - key < sliding_window``; scores become ``tanh(scores / softcap) * softcap``
before the mask), per document: a window by the flash kernel's own window on CUDA, by masked SDPA
elsewhere; a soft-cap, which the flash kernel lacks, by one compiled ``flex_attention`` call on CUDA
(``document_flex``) and written out per document elsewhere.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Iterator

import torch
import torch.nn.functional as F

from . import document_flex, sequence_parallel
from .per_forward import PerForward

NAME = "dyn_varlen"

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None
_VARLEN_ARGS = frozenset(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else frozenset()
# Causal masking is window_size=(-1, 0) from torch 2.11 on, is_causal=True in 2.10 (which has no window).
_WINDOWS = "window_size" in _VARLEN_ARGS
_CAUSAL = {"window_size": (-1, 0)} if _WINDOWS else {"is_causal": True}
# The flash kernel shares each key/value head among its group of query heads itself; torch 2.13's
# varlen_attn refuses fewer key/value heads unless told so, 2.11's hands them to the kernel unasked.
_GQA = {"enable_gqa": True} if "enable_gqa" in _VARLEN_ARGS else {}


def document_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each document in a packed row, from where position ids restart at 0."""
    starts = torch.nonzero(position_ids == 0, as_tuple=False).flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    ends = starts[1:] + [int(position_ids.numel())]
    return list(zip(starts, ends))


def cumulative_offsets(
    position_ids: torch.Tensor | None, batch: int, seq: int, device: torch.device | None = None
) -> tuple[torch.Tensor, int]:
    """(cu_seqlens, longest document) of ``batch`` rows of ``seq`` tokens flattened into one:
    a document starts at every position-id reset and at every row's start."""
    starts = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    if position_ids is not None:
        starts |= (position_ids == 0).expand(batch, seq).to(starts.device)
    starts[:, 0] = True
    offsets = torch.nonzero(starts.flatten()).flatten()
    cu = torch.cat([offsets, offsets.new_tensor([batch * seq])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


# every layer of one forward finds its documents once: the longest document is a host read
_offsets = PerForward()


def flash_exact(
    query: torch.Tensor, key: torch.Tensor, dropout: float, window: int | None, softcap: float | None
) -> bool:
    """Whether torch's flash varlen kernel computes this call as the per-document loop does, on
    CUDA (the caller checks the device): half precision, no dropout (the kernel has none), no
    soft-cap (nor that), whole groups of query heads per key/value head, and a window only where
    the kernel takes one, of at least one token (the module's window 0 sees nothing)."""
    return (
        varlen_attn is not None
        and query.dtype in (torch.bfloat16, torch.float16)
        and dropout == 0.0
        and softcap is None
        and query.shape[1] % key.shape[1] == 0
        and (window is None or (_WINDOWS and window >= 1))
    )


def flex_exact(
    query: torch.Tensor, key: torch.Tensor, dropout: float, window: int | None, softcap: float | None
) -> bool:
    """Whether a soft-capped call, which the flash kernel cannot compute, is one ``flex_attention``
    call computing what the per-document loop does (on CUDA, the caller checks the device): no
    dropout (flex has none), whole groups of query heads, a window of at least one token."""
    return (
        softcap is not None
        and dropout == 0.0
        and query.shape[1] % key.shape[1] == 0
        and (window is None or window >= 1)
    )


def flash_device(query: torch.Tensor) -> bool:
    """Whether torch's flash varlen kernel can run on ``query``'s device (CUDA). One place, so that the
    CPU tests of the flash path's plumbing stand a reference kernel in for it."""
    return query.is_cuda


def flash_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    longest: int,
    scaling: float | None,
    window: int | None = None,
) -> torch.Tensor:
    """query [tokens, heads, d], key/value [tokens, kv_heads, d] -> [tokens, heads, d]: causal attention
    within each document ``cu`` (int32 boundaries, on the device) bounds, in one kernel call. ``longest``
    is a host int: the kernel needs it and reading it from ``cu`` would sync the device."""
    # the kernel's window (left, 0) sees keys up to `left` positions back; the module's, fewer than `window`
    mask = _CAUSAL if window is None else {"window_size": (window - 1, 0)}
    gqa = _GQA if key.shape[1] != query.shape[1] else {}
    return varlen_attn(query, key, value, cu, cu, longest, longest, scale=scaling, **mask, **gqa)


def _one_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids: torch.Tensor | None,
    scaling: float | None,
    window: int | None = None,
    softcap: float | None = None,
    offsets: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """query [b, heads, s, d], key/value [b, kv_heads, s, d] -> [b, s, heads, d], one kernel call
    for every document: flash, or flex where logits are soft-capped. ``offsets``: (cu_seqlens on the
    device, longest document) shipped with the batch, so that the forward reads nothing back from
    the device; else found from ``position_ids``."""
    b, h, s, d = query.shape
    cu, longest = (
        offsets
        if offsets is not None
        else _offsets.get(
            position_ids, (b, s, query.device), lambda: cumulative_offsets(position_ids, b, s, query.device)
        )
    )
    # one document per row (padded rows, packing across documents): dense causal SDPA, which has no
    # window nor cap
    if cu.numel() == b + 1 and window is None and softcap is None:
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=key.shape[1] != h
        )
        return out.transpose(1, 2).contiguous()
    flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (query, key, value)]
    if softcap is not None:
        return document_flex.flex_call(*flat, cu, scaling, window, softcap).reshape(b, s, h, d)
    return flash_call(*flat, cu, longest, scaling, window).view(b, s, h, d)


def _windowed(
    q,
    k,
    v,
    dropout: float,
    scaling: float | None,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    offset: int = 0,
):
    """Causal attention of one document with a sliding window, a logit soft-cap and/or attention
    sinks, as transformers' eager attention computes them. q: [1, heads, s, d], k/v: [1, kv_heads,
    offset + s, d] (``offset`` keys before the queries' first: an earlier shard's). A sink is one
    learned logit per head beside the keys' in the softmax, with no value (GPT-OSS's ``s_aux``)."""
    s, t = q.shape[2], k.shape[2]
    i = torch.arange(offset, offset + s, device=q.device)[:, None]
    j = torch.arange(t, device=q.device)[None, :]
    seen = j <= i
    if window is not None:
        seen &= j > i - window
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=seen, dropout_p=dropout, scale=scaling, enable_gqa=k.shape[1] != q.shape[1]
        )
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    # in fp32 at least, as transformers' eager attention (fp64 stays fp64)
    math = torch.promote_types(q.dtype, torch.float32)
    scores = scores.to(math).masked_fill(~seen, float("-inf"))
    if sinks is not None:
        sink = sinks.to(math).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(q.dtype)
    else:
        weights = torch.softmax(scores, dim=-1).to(q.dtype)
    return F.dropout(weights, p=dropout, training=dropout > 0) @ v


def document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    offsets: tuple[torch.Tensor, int] | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within each document of each row. query: [b, heads, s, d], key/value:
    [b, kv_heads, s, d]; position_ids: [rows, s] (rows = b, or 1 standing for every row), or None
    for one document per row; ``window``: a key is seen by queries fewer than ``window`` positions
    after it; ``softcap``: logits soft-capped at it; ``offsets``: the documents' cu_seqlens (over the
    b rows flattened) and longest length, where the batch carries them; ``sinks``: one logit per
    head beside the keys' (written out per document, on CPU only: ``varlen_attention`` refuses them on
    CUDA). Returns [b, s, heads, d]."""
    if (
        sinks is None
        and flash_device(query)
        and (flash_exact(query, key, dropout, window, softcap) or flex_exact(query, key, dropout, window, softcap))
    ):
        return _one_call(query, key, value, position_ids, scaling, window, softcap, offsets)
    gqa = key.shape[1] != query.shape[1]
    plain = window is None and softcap is None and sinks is None
    rows = []
    for b in range(query.shape[0]):
        q, k, v = query[b : b + 1], key[b : b + 1], value[b : b + 1]
        row = None if position_ids is None else position_ids[min(b, position_ids.shape[0] - 1)]
        bounds = [(0, q.shape[2])] if row is None else document_bounds(row)
        parts = [
            F.scaled_dot_product_attention(
                q[:, :, s:e],
                k[:, :, s:e],
                v[:, :, s:e],
                dropout_p=dropout,
                is_causal=True,
                scale=scaling,
                enable_gqa=gqa,
            )
            if plain
            else _windowed(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], dropout, scaling, window, softcap, sinks)
            for s, e in bounds
        ]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]
    return out.transpose(1, 2).contiguous()


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
    """HF attention-interface function. query: [b, heads, s, d]; returns [b, s, heads, d].

    Inside ``sequence_parallel.sharded(shard)`` with a group of two or more ranks, the inputs are
    this rank's shard of the positions and attention runs over the group (Ulysses or ring), so
    every model built with this kernel is sequence-parallel without a config change."""
    if attention_mask is not None:
        raise ValueError(
            f"{NAME} attention expects attention_mask=None (padded rows are right-padded and causal, "
            "packed rows carry position_ids resets)"
        )
    if kwargs.get("is_causal") is False:
        raise ValueError(
            f"{type(module).__name__} attends bidirectionally, which the plugin's causal {NAME} kernel does not "
            "compute; train this model with its own attention implementation (and padded rows, "
            "microbatching.layout 'padded')"
        )
    sinks = kwargs.get("s_aux")
    if sinks is not None and flash_device(query):
        raise ValueError(
            f"{type(module).__name__} attends with attention sinks (s_aux): on CUDA the plugin's {NAME} kernel "
            "computes them only written out per document, which the plan does not price (torch's flash varlen "
            "kernel has no sinks); train this model with its own attention implementation (and padded rows, "
            "microbatching.layout 'padded')"
        )
    drop = dropout if module.training else 0.0
    # most families pass their window (None on full layers); Qwen2-MoE only sets it on its sliding
    # layers' modules and leaves it to the mask the kernel does not take
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    softcap = kwargs.get("softcap")
    if _carried is not None:
        return _carry(module, query, key, value, scaling, window, softcap, sinks), None
    local = functools.partial(document_attention, window=window, softcap=softcap)
    shard = sequence_parallel.current()
    if shard is not None and shard.size > 1:
        return sequence_parallel.attention(shard, query, key, value, local, drop, scaling, window, softcap, sinks), None
    # the loader ships a packed row's boundaries (dyn_plugin.runtime.collate), or a pipeline stage
    # enters them (documents): no device read in forward
    cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    shipped = cu is not None and longest is not None
    offsets = (cu.to(query.device, non_blocking=True), int(longest)) if shipped else _documents
    return local(query, key, value, kwargs.get("position_ids"), drop, scaling, offsets=offsets, sinks=sinks), None


# Each attention module's keys and values over the forwards run inside ``carrying()`` (the
# start-up check's sequence shards, host/exactness.py): a later forward attends over them too.
_carried: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None


@contextlib.contextmanager
def carrying() -> Iterator[None]:
    """Inside the block, each attention module keeps the keys and values it is called with, and its
    next call attends over them before its own: forwards over consecutive parts of one document
    (positions running on) then compute what sequence parallelism's attention does, in one process,
    while every other module sees only its own part. One row, one document; eager math."""
    global _carried
    previous, _carried = _carried, {}
    try:
        yield
    finally:
        _carried = previous


def _carry(module, query, key, value, scaling, window, softcap, sinks) -> torch.Tensor:
    if query.shape[0] != 1:
        raise ValueError("carrying() attends over one row at a time")
    assert _carried is not None
    earlier = _carried.get(id(module))
    if earlier is not None:
        key, value = torch.cat([earlier[0], key], dim=2), torch.cat([earlier[1], value], dim=2)
    _carried[id(module)] = (key, value)
    offset = key.shape[2] - query.shape[2]
    out = _windowed(query, key, value, 0.0, scaling, window, softcap, sinks, offset)
    return out.transpose(1, 2).contiguous()


# The boundaries of the micro-batch being computed where its caller knows them and the model's call
# does not carry them (DeepSpeed pipeline stages pass only (hidden, positions) between layers). A
# module global, as sequence_parallel's shard: autograd runs a backward's recompute on its own threads.
_documents: tuple[torch.Tensor, int] | None = None


@contextlib.contextmanager
def documents(offsets: tuple[torch.Tensor, int] | None) -> Iterator[None]:
    """Inside the block, attention calls without shipped boundaries take ``offsets`` (cu_seqlens on
    the device over the rows flattened, longest document as a host int): the caller's promise that
    they describe the rows being computed."""
    global _documents
    previous, _documents = _documents, offsets
    try:
        yield
    finally:
        _documents = previous


def register() -> str:
    """Register the kernel with transformers (idempotent); returns its attn_implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)
    return NAME
