"""What sequence parallelism adds to a micro-batch: the attention collectives of its group.

A micro-batch split over ``k`` ranks computes 1/k of its tokens and attention on each rank
(``features(..., sp=k)``) and pays, per transformer layer:

- Ulysses: 4 all-to-alls forward (q, k, v to head shards; the output back to sequence shards)
  and their 4 mirrors backward; each rank keeps 1/k of what it holds and sends the rest.
- ring: k-1 exchanges of a key/value block forward; backward passes the blocks around again
  together with their gradients (twice the bytes).

Recompute re-runs the forward's collectives in backward. Every term is linear in the tokens a
rank holds, so a layer's collectives cost ``a + b * tokens_per_rank`` forward and backward: the
four numbers the planners (and the C++ evaluator) add per layer. Times come from all-to-all and
point-to-point exchanges measured by ``dynplugin profile --ranks N`` on the backend training
uses, scaled to k ranks; without a measurement, from the cluster's link bandwidth and latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from .model import Recompute
from .update import fit_line

AttentionKind = Literal["ulysses", "ring"]


@dataclass(frozen=True)
class LayerComm:
    """Collective time of one layer, ms = intercept + slope * tokens each rank holds."""

    forward: tuple[float, float] = (0.0, 0.0)
    backward: tuple[float, float] = (0.0, 0.0)

    def forward_ms(self, tokens_per_rank: float) -> float:
        return self.forward[0] + self.forward[1] * tokens_per_rank

    def backward_ms(self, tokens_per_rank: float) -> float:
        return self.backward[0] + self.backward[1] * tokens_per_rank

    def as_tuple(self) -> tuple[float, float, float, float]:
        """(forward a, forward b, backward a, backward b): the form the C++ evaluator takes."""
        return (*self.forward, *self.backward)


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
        act_bytes: int,
        link_gb_per_s: float,
        latency_us: float,
    ) -> LayerComm:
        """One transformer layer's collectives for a micro-batch split over ``k`` ranks."""
        if k <= 1:
            return LayerComm()
        rerun = recompute != "none"  # selective and full both re-run the attention, collectives included
        if kind == "ulysses":
            a, b = self.alltoall_ms(1.0, k, link_gb_per_s, latency_us)
            per_token = (2 * hidden + 2 * kv_hidden) * act_bytes  # q and output, k and v
            fwd = (4 * a, b * per_token)
        elif kind == "ring":
            a, b = self.exchange_ms(link_gb_per_s, latency_us)
            per_token = 2 * kv_hidden * act_bytes  # one key and one value block
            fwd = ((k - 1) * a, (k - 1) * b * per_token)
        else:
            raise ValueError(f"attention kind must be 'ulysses' or 'ring', got {kind!r}")
        bwd_factor = 1.0 if kind == "ulysses" else 2.0  # ring backward also moves the key/value gradients
        bwd = (fwd[0] * (bwd_factor + rerun), fwd[1] * (bwd_factor + rerun))
        return LayerComm(fwd, bwd)

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
