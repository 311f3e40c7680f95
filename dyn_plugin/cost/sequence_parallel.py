"""What sequence parallelism adds to a micro-batch: the attention collectives of its group.

A micro-batch split over ``k`` ranks computes 1/k of its tokens and attention on each rank
(``features(..., sp=k)``) and pays, per transformer layer:

- Ulysses: 4 all-to-alls forward (q, k, v to head shards; the output back to sequence shards)
  and their 4 mirrors backward; each rank keeps 1/k of what it holds and sends the rest.
- ring: k-1 exchanges of a key/value block forward; backward passes the blocks around again
  together with their gradients (twice the bytes).

Recompute re-runs the forward's collectives in backward. Every term is linear in the tokens a
rank holds, so a layer's collectives cost ``a + b * tokens_per_rank`` forward and backward: the
four numbers the planners (and the C++ evaluator) add per layer.

The executors' own buffers (``models/sequence_parallel.py``) are memory the measured tables do not
hold, priced per layer from the tokens a rank holds and the attention pairs it computes:

- Ulysses: each all-to-all's output lives beside its input, for q, k, v and the output: a
  transient of (2 hidden + 2 kv_hidden) activations per token.
- ring: the blocks are computed in fp32. It keeps its fp32 output and log-sum-exp for backward
  (stored; a layer that recomputes keeps none) and, while it runs, holds fp32 copies of the query,
  output, their gradients and the travelling key/value gradients, the key/value blocks in flight,
  and up to six fp32 score chunks of its queries against one key block (scores, masked scores,
  probabilities, their gradients), each ``RING_QUERY_CHUNK`` queries of a row against its keys.
 Times come from all-to-all and
point-to-point exchanges measured by ``dynplugin profile --ranks N`` on the backend training
uses, scaled to k ranks; without a measurement, from the cluster's link bandwidth and latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from .model import Recompute
from .update import fit_line

AttentionKind = Literal["ulysses", "ring"]


MATH_BYTES = 4  # the ring's blocks are computed in fp32 (half-precision inputs are upcast)
# The ring computes a block's scores this many queries at a time (models/sequence_parallel.py reads
# it from here), so they grow with the tokens a rank holds, not with their square.
RING_QUERY_CHUNK = 256
# fp32 score blocks alive at once in the ring's backward (s, masked s, s - lse, p, dp, dp - delta,
# ds: measured 5.8 on CPU, tests/sp_attention_worker.py memory)
SCORE_BLOCKS = 6


@dataclass(frozen=True)
class LayerComm:
    """What sequence parallelism adds to one layer: collective time, ms = intercept + slope *
    tokens each rank holds, and the executor's buffers, bytes = per token * tokens + per pair *
    attention pairs each rank computes (``Features.slots`` and ``Features.attn``)."""

    forward: tuple[float, float] = (0.0, 0.0)
    backward: tuple[float, float] = (0.0, 0.0)
    stored: tuple[float, float] = (0.0, 0.0)  # kept from forward to backward: per token, per pair
    transient: tuple[float, float, float] = (0.0, 0.0, 0.0)  # while the attention runs: fixed, per token, per pair

    def stored_bytes(self, slots: float, attn: float) -> float:
        return self.stored[0] * slots + self.stored[1] * attn

    def transient_bytes(self, slots: float, attn: float) -> float:
        return self.transient[0] + self.transient[1] * slots + self.transient[2] * attn

    def forward_ms(self, tokens_per_rank: float) -> float:
        return self.forward[0] + self.forward[1] * tokens_per_rank

    def backward_ms(self, tokens_per_rank: float) -> float:
        return self.backward[0] + self.backward[1] * tokens_per_rank

    def as_tuple(self) -> tuple[float, ...]:
        """(forward a, forward b, backward a, backward b, stored per token, per pair, transient
        fixed, per token, per pair): the form the C++ evaluator takes."""
        return (*self.forward, *self.backward, *self.stored, *self.transient)


@dataclass(frozen=True)
class SequenceParallelCost:
    """Measured collectives among ``ranks`` processes, ms = c0 + c1 * bytes: for the all-to-all,
    the bytes of each rank's buffer (it keeps 1/ranks of it and sends the rest); for a ring
    exchange, the bytes of the block each rank sends to its successor while it receives one."""

    alltoall: tuple[float, float] | None = None
    p2p: tuple[float, float] | None = None  # one exchange: send a block to the next rank, receive one
    ranks: int = 2

    def alltoall_ms(self, nbytes: float, k: int, link_gb_per_s: float, latency_us: float) -> tuple[float, float]:
        """(fixed ms, ms per byte of ``nbytes``) of one all-to-all of ``nbytes`` per rank over k ranks.
        Unmeasured: one launch's latency, as NCCL runs an all-to-all as one grouped call whose peers
        progress together (a latency per peer made 16-32-rank groups look 15-31x dearer), plus the
        bytes a rank sends over the link."""
        share = (k - 1) / k  # a rank keeps 1/k of its buffer
        if self.alltoall is None:
            return latency_us / 1e3, share / (link_gb_per_s * 1e6)
        measured_share = (self.ranks - 1) / self.ranks
        return self.alltoall[0], self.alltoall[1] * share / measured_share

    def exchange_ms(self, link_gb_per_s: float, latency_us: float) -> tuple[float, float]:
        """(fixed ms, ms per byte) of one ring step."""
        if self.p2p is None:
            return latency_us / 1e3, 1.0 / (link_gb_per_s * 1e6)
        return self.p2p

    def layer(
        self,
        k: int,
        kind: AttentionKind,
        recompute: Recompute,
        *,
        hidden: int,
        kv_hidden: int,
        heads: int,
        act_bytes: int,
        link_gb_per_s: float,
        latency_us: float,
    ) -> LayerComm:
        """One transformer layer's collectives and buffers for a micro-batch split over ``k``
        ranks; ``hidden``, ``kv_hidden`` and ``heads`` are a tensor-parallel rank's share."""
        if k <= 1:
            return LayerComm()
        rerun = recompute != "none"  # selective and full both re-run the attention, collectives included
        if kind == "ulysses":
            a, b = self.alltoall_ms(1.0, k, link_gb_per_s, latency_us)
            per_token = (2 * hidden + 2 * kv_hidden) * act_bytes  # q and output, k and v
            fwd = (4 * a, b * per_token)
            stored, transient = (0.0, 0.0), (0.0, float(per_token), 0.0)
        elif kind == "ring":
            a, b = self.exchange_ms(link_gb_per_s, latency_us)
            per_token = 2 * kv_hidden * act_bytes  # one key and one value block
            fwd = ((k - 1) * a, (k - 1) * b * per_token)
            # fp32 output and log-sum-exp, and the whole rows' document ids (int64)
            kept = 0.0 if rerun else float(MATH_BYTES * (hidden + heads) + 8 * k)
            # fp32 query, output and their gradients; key/value blocks held and incoming; their
            # fp32 gradients held and incoming
            working = MATH_BYTES * 4 * hidden + 2 * per_token + 2 * MATH_BYTES * 2 * kv_hidden
            # score chunks: RING_QUERY_CHUNK queries of each row against the rank's keys, per head
            score = SCORE_BLOCKS * MATH_BYTES * heads * RING_QUERY_CHUNK
            stored, transient = (kept, 0.0), (0.0, float(working + score), 0.0)
        else:
            raise ValueError(f"attention kind must be 'ulysses' or 'ring', got {kind!r}")
        bwd_factor = 1.0 if kind == "ulysses" else 2.0  # ring backward also moves the key/value gradients
        bwd = (fwd[0] * (bwd_factor + rerun), fwd[1] * (bwd_factor + rerun))
        return LayerComm(fwd, bwd, stored, transient)

    def to_dict(self) -> dict:
        return {"alltoall": self.alltoall, "p2p": self.p2p, "ranks": self.ranks}

    @classmethod
    def from_dict(cls, d: dict | None) -> "SequenceParallelCost":
        d = d or {}
        pair = lambda v: None if v is None else (float(v[0]), float(v[1]))  # noqa: E731
        return cls(pair(d.get("alltoall")), pair(d.get("p2p")), int(d.get("ranks", 2)))

    @classmethod
    def fit(
        cls, alltoall: Sequence[Sequence[float]] | None, p2p: Sequence[Sequence[float]] | None, ranks: int
    ) -> "SequenceParallelCost":
        """From measured (bytes, ms) points among ``ranks`` processes: an all-to-all of a buffer of
        that many bytes per rank, and one ring exchange of a block of that many bytes."""
        return cls(fit_line(alltoall), fit_line(p2p), ranks)


def attention_kind(k: int, wanted: str, num_heads: int | None, num_kv_heads: int | None) -> AttentionKind:
    """The attention a group of ``k`` ranks runs: Ulysses shards heads, so it needs k to divide
    the query and the key/value heads; ring works for any k. ``wanted``: ulysses | ring | auto."""
    heads = num_heads or 0
    kv = num_kv_heads or heads
    divides = heads > 0 and heads % k == 0 and kv % k == 0
    if wanted == "ring" or k <= 1:
        return "ring" if k > 1 else "ulysses"
    if wanted == "ulysses":
        if not divides:
            raise ValueError(
                f"sequence_parallel.attention = 'ulysses' with a group of {k} ranks: Ulysses splits the "
                f"heads over the group, and {heads} query / {kv} key-value heads do not divide by {k}; "
                "use attention 'ring' or 'auto', or leave size "
                f"{k} out of sequence_parallel.sizes"
            )
        return "ulysses"
    return "ulysses" if divides else "ring"


def group_sizes(columns: int, allowed: Sequence[int]) -> tuple[int, ...]:
    """The allowed sizes that fit ``columns`` data-parallel columns, ascending. Without 1 every
    sequence is split (a fixed sequence-parallel size, as DeepSpeed Ulysses runs it)."""
    sizes = tuple(sorted({k for k in allowed if k <= columns}))
    if not sizes:
        raise ValueError(
            f"sequence_parallel.sizes = {list(allowed)}: none fits the {columns} data-parallel columns; "
            f"allow a size <= {columns}, e.g. [1, 2]"
        )
    return sizes
