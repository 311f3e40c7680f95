"""What each sharding choice of each unit costs, per rank and step: memory, communication, and
the part of it compute does not hide (the search in plan/sharding/search.py picks one per unit).

Per rank, with N = shard size, R = world / N replicas, M micro-batches in the step, P a unit's
parameters and p, g, o the bytes per parameter of weights, gradients and optimizer state:

memory (persistent, plus what the choice holds at the step's peak)
    replicate   P(p+g+o)                (fsdp2: + P p, the unsharded copy it holds for the step)
    keep        P(p+g+o)/N + P p + P g  (gathered for the whole step, gradients accumulate unsharded)
    grad_op     P(p+g+o)/N + P p        (gathered from its forward to its backward)
    full        P(p+g+o)/N
    reshard(r)  P(p+g+o)/N + P p / r    (sharded over r ranks between forward and backward)
    split(s/k)  s/k of full + (k-s)/k of keep
  and once per plan, if any unit gathers on use (full, reshard, split), the reserve: the largest
  such unit's P(2p+g) (the unit in use, the one prefetched, the gradient being reduce-scattered).
  FSDP2 runs replicate as a shard group of one rank, and even there it gathers: it copies the
  parameters into an unsharded buffer on first use and frees it only at the reshard after the
  step's last backward (measured: tiny-llama all replicate on 2 ranks peaks exactly P p above
  P(p+g+o) + activations; FSDP1's NO_SHARD at exactly P(p+g+o) + activations: it trains in place,
  and ZeRO-3 keeps its persistent parameters whole, never gathered).

communication (AG = all-gather of P p over N, RS = reduce-scatter of P g over N, each RS followed
by an all-reduce of P g / N over the R replicas when R > 1, AR = all-reduce of P g over the world)
    replicate   AR once per step (FSDP1's NO_SHARD: every micro-batch)
    keep        AG before the first micro-batch, RS after the last (FSDP1 runs it as SHARD_GRAD_OP:
                AG and RS every micro-batch)
    grad_op     per micro-batch AG + RS
    full        per micro-batch 2 AG + RS
    reshard(r)  per micro-batch AG + AG of P p over r + RS
    split(s/k)  its k slices are units of their own: s run full, k-s keep (as hosts wrap them)

Each collective runs beside a neighbour's compute (units in forward order): a forward gather
beside the previous unit's forward (prefetch), a backward gather beside the next unit's
backward, a reduction beside the previous unit's backward. Exposed is what ``overlap`` times
that compute cannot hide, per micro-batch, per kind of collective: max(0, comm - overlap *
compute). Collectives of different units are priced apart (FSDP runs gathers and reductions on
streams of their own), so two of them sharing one neighbour each count its whole compute.

Collectives are priced from the measured lines of ``UpdateCost`` where the profile has them
(scaled by the ring factor to the group's size), else from the cluster's links: inside a node
when the group's ranks fit in one (groups are consecutive ranks: the shard group, the reshard
group inside it; the replica group strides over them, so it spans the world), else between nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import numpy as np

from ..config import ClusterConfig
from .model import Precision
from .update import UpdateCost

HOST_KINDS: dict[str, tuple[str, ...]] = {
    "fsdp2": ("replicate", "keep", "grad_op", "full", "reshard", "split"),
    "fsdp1": ("replicate", "keep", "grad_op", "full", "split"),  # no per-module reshard to a smaller group
    "zero3": ("replicate", "full"),  # persistent (below the threshold) or partitioned: deepspeed_ext/zero3.py
}
OPENS = ("full", "reshard", "split")  # kinds that gather on use and need the reserve
_FWD, _BWD, _RED = range(3)  # collectives beside: forward (gathers), backward (gathers), backward (reductions)
_EVERY, _FIRST, _LAST = range(3)  # in every micro-batch, only the first, only the last


class Unit(Protocol):
    """A sharding unit (plan/sharding/shard_plan.py ``ShardUnit``)."""

    name: str
    params: int
    component: str
    layer: int
    linear_out: int


class ChoiceLike(Protocol):
    """A sharding choice (plan/sharding/shard_plan.py ``Choice``)."""

    kind: str
    reshard_to: int
    slices: int
    sharded: int


@dataclass(frozen=True)
class Links:
    """Prices collectives among groups of ranks: measured lines where there are, else the links."""

    update: UpdateCost
    devices_per_node: int
    intra_gb_per_s: float
    inter_gb_per_s: float
    latency_us: float

    @classmethod
    def of(cls, cluster: ClusterConfig, update: UpdateCost) -> "Links":
        return cls(
            update,
            cluster.devices_per_node,
            cluster.intra_node_gb_per_s,
            cluster.inter_node_gb_per_s,
            cluster.latency_us,
        )

    def _link(self, span: int) -> float:
        return self.intra_gb_per_s if span <= self.devices_per_node else self.inter_gb_per_s

    def allgather_ms(self, nbytes: np.ndarray, n: int, span: int) -> np.ndarray:
        """All-gather of ``nbytes`` (gathered) among ``n`` ranks spread over ``span`` consecutive ranks."""
        return self.update.allgather_ms(nbytes, n, self._link(span), self.latency_us)

    def reducescatter_ms(self, nbytes: np.ndarray, n: int, span: int) -> np.ndarray:
        return self.update.reducescatter_ms(nbytes, n, self._link(span), self.latency_us)

    def allreduce_ms(self, nbytes: np.ndarray, n: int, span: int) -> np.ndarray:
        return self.update.allreduce_ms(nbytes, n, self._link(span), self.latency_us)


@dataclass(frozen=True)
class Prices:
    """Every unit (rows, forward order) under every choice (columns)."""

    memory_bytes: np.ndarray  # [unit, choice]
    comm_ms: np.ndarray  # [unit, choice] communication per step
    exposed_ms: np.ndarray  # [unit, choice] the part of it compute does not hide
    optimizer_ms: np.ndarray  # [unit, choice] the optimizer step's time per parameter, on those this rank updates
    allowed: np.ndarray  # [unit, choice] bool
    opens: np.ndarray  # [choice] bool: gathers on use (needs the reserve)
    reserve_bytes: np.ndarray  # [unit]: P(2p+g)

    @property
    def time_ms(self) -> np.ndarray:
        """What the search minimises: exposed communication and the optimizer's share; inf where not allowed."""
        return np.where(self.allowed, self.exposed_ms + self.optimizer_ms, np.inf)


LAYER_COMPONENTS = ("layer", "encoder", "decoder")  # a decoder-only model's layers; an encoder-decoder's per side


def unit_compute(
    units: Sequence[Unit],
    component_ms: Mapping[str, tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) ms of each unit in each micro-batch, [unit, micro-batch].

    ``component_ms``: per component ("embedding", "head", and for one layer "layer", or an
    encoder-decoder's "encoder" and "decoder"), (forward, backward) ms per micro-batch. A layer's
    unit gets its layer's time times its share of the layer's parameters; the embedding and head
    units their component's; the root ("other") whatever component has no unit of its own (a tied
    head), else nothing.
    """
    zero = np.zeros_like(np.asarray(component_ms["head"][0], dtype=float))
    layer_params: dict[tuple[str, int], float] = {}
    per_layer: dict[tuple[str, int], int] = {}
    for u in units:
        if u.component in LAYER_COMPONENTS:
            key = (u.component, u.layer)
            layer_params[key] = layer_params.get(key, 0) + u.params
            per_layer[key] = per_layer.get(key, 0) + 1
    owned = {u.component for u in units}
    fwd, bwd = [], []
    for u in units:
        if u.component in LAYER_COMPONENTS:
            total = layer_params[(u.component, u.layer)]
            share = u.params / total if total else 1.0 / per_layer[(u.component, u.layer)]
            fwd.append(share * np.asarray(component_ms[u.component][0], dtype=float))
            bwd.append(share * np.asarray(component_ms[u.component][1], dtype=float))
        elif u.component in ("embedding", "head"):
            fwd.append(np.asarray(component_ms[u.component][0], dtype=float))
            bwd.append(np.asarray(component_ms[u.component][1], dtype=float))
        else:
            orphans = [c for c in ("embedding", "head") if c not in owned]
            fwd.append(sum((np.asarray(component_ms[c][0], dtype=float) for c in orphans), zero))
            bwd.append(sum((np.asarray(component_ms[c][1], dtype=float) for c in orphans), zero))
    return np.array(fwd), np.array(bwd)


def price(
    units: Sequence[Unit],
    choices: Sequence[ChoiceLike],
    *,
    dtype: str,
    world: int,
    shard_size: int,
    forward_ms: np.ndarray,
    backward_ms: np.ndarray,
    links: Links,
    overlap: float = 1.0,
    host: str = "fsdp2",
) -> Prices:
    """Memory, communication and exposed time of every unit (in forward order) under every choice,
    per rank and step; ``forward_ms``/``backward_ms``: [unit, micro-batch] (``unit_compute``)."""
    if host not in HOST_KINDS:
        raise ValueError(f"sharding host {host!r} is unknown; choose one of {', '.join(HOST_KINDS)}")
    if world % shard_size:
        raise ValueError(f"shard_size {shard_size} does not divide the world of {world} ranks")
    bad = [c.kind for c in choices if c.kind not in HOST_KINDS[host]]
    if bad:
        raise ValueError(
            f"{host} cannot run sharding choice(s) {sorted(set(bad))}; it runs {', '.join(HOST_KINDS[host])}"
        )
    prec = Precision.of(dtype)
    p, g, o = prec.param, prec.grad, prec.optimizer
    P = np.array([u.params for u in units], dtype=float)
    fwd, bwd = np.asarray(forward_ms, dtype=float), np.asarray(backward_ms, dtype=float)
    if fwd.shape != bwd.shape or fwd.shape[0] != len(units) or fwd.shape[1] < 1:
        raise ValueError(
            f"forward_ms and backward_ms must be [units={len(units)}, micro-batches >= 1]; got "
            f"{fwd.shape} and {bwd.shape}"
        )
    M = fwd.shape[1]
    N, R = shard_size, world // shard_size
    zero = np.zeros((1, M))
    # per kind of collective, [unit, micro-batch]: the compute beside it
    hide = overlap * np.stack(
        [np.concatenate([zero, fwd[:-1]]), np.concatenate([bwd[1:], zero]), np.concatenate([zero, bwd[:-1]])]
    )
    step_once = host != "fsdp1"  # FSDP1 cannot keep a module gathered, or gradients unreduced, across micro-batches

    def reduce(params: np.ndarray) -> np.ndarray:
        rs = links.reducescatter_ms(params * g, N, N)
        return rs + links.allreduce_ms(params * g / N, R, world) if R > 1 else rs

    def amounts(kind: str, params: np.ndarray, r: int = 0) -> np.ndarray:
        """[collective kind, when, unit] ms of one choice for units of ``params`` parameters."""
        a = np.zeros((3, 3, len(params)))
        if kind == "replicate":
            a[_RED, _LAST if step_once else _EVERY] = links.allreduce_ms(params * g, world, world)
        elif kind == "keep":
            a[_FWD, _FIRST if step_once else _EVERY] = links.allgather_ms(params * p, N, N)
            a[_RED, _LAST if step_once else _EVERY] = reduce(params)
        else:  # grad_op, full, reshard: gathered for forward, gradients reduced, every micro-batch
            a[_FWD, _EVERY] = links.allgather_ms(params * p, N, N)
            a[_RED, _EVERY] = reduce(params)
            if kind == "full":
                a[_BWD, _EVERY] = a[_FWD, _EVERY]
            elif kind == "reshard":
                a[_BWD, _EVERY] = links.allgather_ms(params * p, r, r)
        return a

    states = P * (p + g + o)
    cols = len(choices)
    memory, comm, exposed, optim = (np.zeros((len(units), cols)) for _ in range(4))
    allowed = np.ones((len(units), cols), dtype=bool)
    per_param = links.update.optimizer[1] if links.update.optimizer else 0.0
    for j, c in enumerate(choices):
        if c.kind == "split":
            k, s = c.slices, c.sharded
            a = s * amounts("full", P / k) + (k - s) * amounts("keep", P / k)
            memory[:, j] = states / N + (k - s) / k * P * (p + g)
            allowed[:, j] = [u.linear_out > 0 and u.linear_out % k == 0 for u in units]
        else:
            a = amounts(c.kind, P, c.reshard_to)
            memory[:, j] = {
                "replicate": states + (P * p if host == "fsdp2" else 0.0),
                "keep": states / N + P * (p + g),
                "grad_op": states / N + P * p,
                "full": states / N,
                "reshard": states / N + P * p / max(c.reshard_to, 1),
            }[c.kind]
        # per micro-batch: every one, plus the first's and the last's (one and the same when M = 1)
        per_mb = np.repeat(a[:, _EVERY, :, None], M, axis=2)
        per_mb[:, :, 0] += a[:, _FIRST]
        per_mb[:, :, -1] += a[:, _LAST]
        comm[:, j] = per_mb.sum(axis=(0, 2))
        exposed[:, j] = np.maximum(per_mb - hide, 0.0).sum(axis=(0, 2))
        optim[:, j] = per_param * (P if c.kind == "replicate" else P / N)
    opens = np.array([c.kind in OPENS for c in choices], dtype=bool)
    return Prices(memory, comm, exposed, optim, allowed, opens, P * (2 * p + g))


__all__ = ["HOST_KINDS", "LAYER_COMPONENTS", "OPENS", "Links", "Prices", "price", "unit_compute"]
