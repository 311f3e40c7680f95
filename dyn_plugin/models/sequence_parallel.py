"""Attention over a sequence-parallel group: each of its k ranks holds a contiguous 1/k of every row's positions.

Two algorithms, both exact (the result equals per-document causal attention over the whole rows):

- Ulysses (DeepSpeed-Ulysses): an all-to-all turns [b, heads, s/k, d] into [b, heads/k, s, d], the
  plugin's per-document kernel runs on whole rows for a k-th of the heads, and an all-to-all turns
  the output back. Query and key/value head counts must divide by k.
- Ring: each rank keeps its query block while the key/value blocks travel round the group (k - 1
  exchanges); block outputs merge by log-sum-exp. Any head count works, so it serves k above the
  key/value heads of grouped-query attention. The backward runs flash-attention's recurrence per
  block from the saved log-sum-exp, and the key/value gradients travel round the ring back to
  their owners. Sliding windows mask each block by the queries' distance from its keys, and
  soft-capped logits are capped per block before the merge (and the gradient goes back through
  the cap), so Mistral, Qwen2 and Gemma attend exactly as under Ulysses.

Documents are found from the whole micro-batch's ``position_ids`` (restarting at 0 per document),
which the shard carries: a rank's own positions cannot tell whether its first token continues a
document of the previous rank.

The group travels with the micro-batch: the runtime enters ``sharded(shard)`` around a
micro-batch's forward and around its backward, so activation recompute in backward re-runs
attention with its own forward's group; the autograd functions keep their group from forward.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from ..cost import sequence_parallel as priced

KINDS = ("ulysses", "ring")

# The per-document kernel the Ulysses path runs on whole rows: (query, key, value, position_ids,
# dropout, scaling) -> [b, s, heads, d] (varlen_attention.document_attention).
LocalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, "float | None"], torch.Tensor]


@dataclass(frozen=True)
class SequenceShard:
    """This rank's part of a sequence-parallel micro-batch.

    ``position_ids`` [rows, width] are the WHOLE micro-batch's (before sharding), on the compute
    device; packed rows restart at 0 per document (the padding document at the end too), padded
    rows run 0..width-1. Rank ``index`` holds positions [index * width/size, (index+1) * width/size).
    """

    group: dist.ProcessGroup
    size: int
    index: int
    kind: str
    position_ids: torch.Tensor

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"SequenceShard.kind is {self.kind!r}; known: {', '.join(KINDS)}")
        if dist.get_world_size(self.group) != self.size:
            raise ValueError(
                f"SequenceShard.size is {self.size} but its group has {dist.get_world_size(self.group)} ranks"
            )
        if dist.get_rank(self.group) != self.index:
            raise ValueError(
                f"SequenceShard.index is {self.index} but this rank is {dist.get_rank(self.group)} in "
                "its group (-1: not a member); the index is the rank's position in the group"
            )
        if self.position_ids.dim() != 2 or self.position_ids.shape[1] % self.size:
            raise ValueError(
                f"SequenceShard.position_ids must be [rows, width] with width a multiple of size "
                f"{self.size}; got shape {tuple(self.position_ids.shape)} (pad the rows to a multiple "
                "of k)"
            )

    @property
    def own_positions(self) -> torch.Tensor:
        """[rows, width / size]: the positions of this rank's part of every row."""
        own = self.position_ids.shape[1] // self.size
        return self.position_ids[:, self.index * own : (self.index + 1) * own]

    @functools.cached_property
    def documents(self) -> torch.Tensor:
        """[rows, width] document number of every position (computed once per micro-batch, on its device)."""
        return torch.cumsum(self.position_ids == 0, dim=-1)


# A module global, not a thread-local: autograd runs the backward of device tensors (and the
# recompute inside it) on its own threads, which must see the group the caller entered.
_current: SequenceShard | None = None


@contextlib.contextmanager
def sharded(shard: SequenceShard | None) -> Iterator[SequenceShard | None]:
    """Run attention over ``shard``'s group inside the block (None: unsharded)."""
    global _current
    previous, _current = _current, shard
    try:
        yield shard
    finally:
        _current = previous


def current() -> SequenceShard | None:
    return _current


def attention(
    shard: SequenceShard,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    local: LocalAttention,
    dropout: float = 0.0,
    scaling: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query: [b, heads, s/k, d], key: [b, kv_heads, s/k, d], value: [b, kv_heads, s/k, dv] (dv may
    differ from d: multi-head latent attention), this rank's positions; returns this rank's output
    [b, s/k, heads, dv]. ``local`` is the per-document kernel Ulysses runs (with ``window`` and
    ``softcap`` bound, as ``varlen_attention`` gives it; it takes the ``sinks`` of its heads); the ring
    applies all three itself: a key is seen by the queries fewer than ``window`` positions after it,
    scores are soft-capped (``softcap * tanh(score / softcap)``) before the softmax, and ``sinks``
    ([heads], one logit each beside the keys', with no value) join the softmax after the merge."""
    heads, kv_heads, width = query.shape[1], key.shape[1], shard.position_ids.shape[1]
    if query.shape[2] * shard.size != width:
        raise ValueError(
            f"sequence-parallel attention got {query.shape[2]} positions per rank, but the shard's "
            f"position_ids hold {width} = {shard.size} x {width // shard.size}: the shard must describe "
            "the micro-batch being run"
        )
    if shard.kind == "ulysses":
        if heads % shard.size or kv_heads % shard.size:
            raise ValueError(
                f"Ulysses attention splits heads over the group: {heads} query and {kv_heads} key/value "
                f"heads must both divide by the group size {shard.size}; set sequence_parallel.attention "
                "to 'ring' or 'auto' (ring where they do not divide)"
            )
        if sinks is not None:  # each rank attends with its block of heads after the all-to-all
            per = heads // shard.size
            local = functools.partial(local, sinks=sinks[shard.index * per : (shard.index + 1) * per])
        return _ulysses(shard, query, key, value, local, dropout, scaling)
    if dropout > 0:
        raise ValueError(
            f"ring attention has no attention dropout (got {dropout}): set the model's attention "
            "dropout to 0, or use Ulysses (sequence_parallel.attention 'ulysses')"
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    limits = (window, softcap)
    return _RingAttention.apply(
        query, key, value, sinks, shard.documents, shard.group, shard.index, shard.size, scale, limits
    )


# --- Ulysses -----------------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """x[j] goes to rank j; returns y with y[j] from rank j (leading dimension = group size)."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """With equal splits the all-to-all is its own adjoint: the gradient goes back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad.contiguous(), ctx.group), None


def _heads_to_positions(x: torch.Tensor, group: dist.ProcessGroup, k: int) -> torch.Tensor:
    """[b, h, s/k, d] (my positions, all heads) -> [b, h/k, s, d] (all positions, my heads)."""
    b, h, n, d = x.shape
    y = _AllToAll.apply(x.reshape(b, k, h // k, n, d).transpose(0, 1).contiguous(), group)  # y[j]: rank j's positions
    return y.permute(1, 2, 0, 3, 4).reshape(b, h // k, k * n, d)


def _positions_to_heads(x: torch.Tensor, group: dist.ProcessGroup, k: int) -> torch.Tensor:
    """[b, s, h/k, d] (all positions, my heads) -> [b, s/k, h, d] (my positions, all heads)."""
    b, s, h, d = x.shape
    y = _AllToAll.apply(x.reshape(b, k, s // k, h, d).transpose(0, 1).contiguous(), group)  # y[j]: rank j's heads
    return y.permute(1, 2, 0, 3, 4).reshape(b, s // k, k * h, d)


def _ulysses(shard: SequenceShard, query, key, value, local: LocalAttention, dropout: float, scaling) -> torch.Tensor:
    # Query head block j uses key/value head block j (heads/kv_heads queries share a key/value
    # head), so splitting both head counts into k blocks keeps grouped-query attention intact.
    q, k, v = (_heads_to_positions(t, shard.group, shard.size) for t in (query, key, value))
    return _positions_to_heads(local(q, k, v, shard.position_ids, dropout, scaling), shard.group, shard.size)


# --- Ring --------------------------------------------------------------------------------------


def _pass_on(send: torch.Tensor, group: dist.ProcessGroup, index: int, size: int) -> tuple[torch.Tensor, list]:
    """Start sending ``send`` to the next rank of the ring and receiving the previous rank's; the
    send and the receive are posted together (NCCL sends rendezvous with the peer's receive)."""
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, group=group, group_peer=(index + 1) % size),
        dist.P2POp(dist.irecv, recv, group=group, group_peer=(index - 1) % size),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _chunks(n: int) -> list[slice]:
    """Query slices of a block of ``n`` queries: ``RING_QUERY_CHUNK`` at a time, the bound the
    planners price the ring's score memory by."""
    step = priced.RING_QUERY_CHUNK
    return [slice(lo, min(lo + step, n)) for lo in range(0, n, step)]


def _scores(
    q: torch.Tensor, k: torch.Tensor, docs: torch.Tensor, index: int, block: int, limits: tuple, rows: slice
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked scores of my queries ``rows`` (a chunk of my block) against key block ``block``: q
    [b, kv, g, c, d] (those queries, scaled, in the math dtype), k [b, kv, n, d] -> [b, kv, g, c, n],
    and the soft-cap's derivative (None without one). A query sees a key of its own document at or
    before its global position, fewer than ``window`` positions back (positions run on within a
    document); earlier blocks are before it, so only the diagonal block needs the causal triangle."""
    window, softcap = limits
    n = k.shape[2]
    mine = torch.arange(rows.start, rows.stop, device=docs.device)[:, None]  # query offsets in my block
    keys = torch.arange(n, device=docs.device)
    seen = docs[:, index * n + rows.start : index * n + rows.stop, None] == docs[:, None, block * n : (block + 1) * n]
    if block == index:
        seen &= keys <= mine
    if window is not None:
        seen &= (index - block) * n + mine - keys < window
    s = q @ k.to(q.dtype).unsqueeze(2).transpose(-1, -2)
    slope = None
    if softcap is not None:  # capped before masking: tanh would turn -inf into -softcap
        t = torch.tanh(s / softcap)
        s, slope = t * softcap, 1 - t * t
    return s.masked_fill(~seen[:, None, None], float("-inf")), slope


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for half precision (the softmax statistics need it), the input's own dtype above."""
    return torch.promote_types(x.dtype, torch.float32)


class _RingAttention(torch.autograd.Function):
    """Blocks are computed in fp32 at least, in chunks of queries (``_chunks``). Rank i
    needs key blocks j <= i only (causal), but every block passes every rank, so the ring's
    exchanges stay in step. Keys and values travel as one tensor, side by side in the last
    dimension (their widths may differ: multi-head latent attention). Sinks join the log-sum-exp
    once every block is merged: a key of their own, scored the same for every query, with no value."""

    @staticmethod
    def forward(ctx, query, key, value, sinks, docs, group, index: int, size: int, scale: float, limits: tuple):
        b, h, n, d = query.shape
        kv_heads, dv = key.shape[1], value.shape[-1]
        q = query.to(_math_dtype(query)).view(b, kv_heads, h // kv_heads, n, d) * scale
        out = q.new_zeros((*q.shape[:-1], dv))
        lse = q.new_full(q.shape[:-1], float("-inf"))
        kv = torch.cat([key, value.to(key.dtype)], dim=-1)
        for step in range(size):
            block = (index - step) % size
            if step < size - 1:  # the next block is on its way while this one is computed
                incoming, works = _pass_on(kv, group, index, size)
            if block <= index:  # step 0 is the diagonal block, where every query sees itself: lse is finite after it
                v = kv[..., d:].to(q.dtype).unsqueeze(2)
                for rows in _chunks(n):
                    s, _ = _scores(q[..., rows, :], kv[..., :d], docs, index, block, limits, rows)
                    merged = torch.logaddexp(lse[..., rows], torch.logsumexp(s, dim=-1))
                    out[..., rows, :] = (
                        out[..., rows, :] * torch.exp(lse[..., rows] - merged).unsqueeze(-1)
                        + torch.exp(s - merged.unsqueeze(-1)) @ v
                    )
                    lse[..., rows] = merged
            if step < size - 1:
                _wait(works)
                kv = incoming
        if sinks is not None:
            sink = sinks.to(q.dtype).view(1, kv_heads, h // kv_heads, 1)
            merged = torch.logaddexp(lse, sink)
            out = out * torch.exp(lse - merged).unsqueeze(-1)
            lse = merged
        ctx.save_for_backward(query, key, value, sinks, docs, out, lse)
        ctx.ring = (group, index, size, scale, limits)
        return out.view(b, h, n, dv).transpose(1, 2).to(query.dtype).contiguous()

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, sinks, docs, out, lse = ctx.saved_tensors
        group, index, size, scale, limits = ctx.ring
        b, h, n, d = query.shape
        kv_heads, dv = key.shape[1], value.shape[-1]
        q = query.to(out.dtype).view(*out.shape[:-1], d) * scale
        dout = grad_out.to(out.dtype).transpose(1, 2).reshape(out.shape)
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO * O), flash-attention's D
        dq = torch.zeros_like(q)
        kv = torch.cat([key, value.to(key.dtype)], dim=-1)
        dkv = q.new_zeros((b, kv_heads, n, d + dv))  # the gradient of the block held now, travelling with it
        for step in range(size):
            block = (index - step) % size
            if step < size - 1:
                incoming, works = _pass_on(kv, group, index, size)
            if block <= index:
                k, v = kv[..., :d].to(q.dtype).unsqueeze(2), kv[..., d:].to(q.dtype).unsqueeze(2)
                for rows in _chunks(n):
                    s, slope = _scores(q[..., rows, :], kv[..., :d], docs, index, block, limits, rows)
                    p = torch.exp(s - lse[..., rows].unsqueeze(-1))
                    dkv[..., d:] += (p.transpose(-1, -2) @ dout[..., rows, :]).sum(2)
                    ds = p * (dout[..., rows, :] @ v.transpose(-1, -2) - delta[..., rows, :])
                    if slope is not None:  # through the cap to the raw score
                        ds = ds * slope
                    dq[..., rows, :] += ds @ k
                    dkv[..., :d] += (ds.transpose(-1, -2) @ q[..., rows, :]).sum(2)  # q carries the scale already
            if step < size - 1:  # finished before the gradients go, so the two exchanges never interleave
                _wait(works)
                kv = incoming
            # after the last step a gradient sits one rank before its block's owner: it moves once more
            received, dkv_works = _pass_on(dkv, group, index, size)
            _wait(dkv_works)  # the sent buffer stays referenced until its send is done
            dkv = received
        dsinks = None
        if sinks is not None:  # a sink's probability times (its value 0 - D), summed over this rank's queries
            sink = sinks.to(q.dtype).view(1, kv_heads, h // kv_heads, 1)
            dsinks = -(torch.exp(sink - lse) * delta.squeeze(-1)).sum((0, 3)).reshape(h).to(sinks.dtype)
        dq = (dq * scale).view(b, h, n, d).to(query.dtype)
        dk, dv_ = dkv[..., :d].to(key.dtype), dkv[..., d:].to(value.dtype)
        return dq, dk, dv_, dsinks, None, None, None, None, None, None
