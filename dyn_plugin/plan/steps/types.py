"""The plan dataclasses every planner produces and every runtime piece consumes: micro-batches,
schedules, and the replica and step plans built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...cost.model import Layout, Recompute


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of one pipeline replica, priced on every pipeline stage.

    ``sample_ids`` index the global batch; ``seq_lens`` are their lengths in the same order.
    Per-stage tuples have one entry per pipeline stage. Costs, memory and ``activation_bytes``
    are per rank: with sequence parallelism (``sp`` > 1) each rank of the replica's group holds
    1/sp of every row (``local_shape``) and the attention collectives are priced in.
    """

    sample_ids: tuple[int, ...]
    seq_lens: tuple[int, ...]
    layout: Layout
    recompute: Recompute
    forward_ms: tuple[float, ...]
    backward_ms: tuple[float, ...]
    stored_bytes: tuple[float, ...]
    peak_bytes: tuple[float, ...]
    activation_bytes: float  # one stage's output (= the next stage's input), sent between stages
    shape: tuple[int, int]  # (rows, row length) of the whole token tensor: padded [n, S], packed [1, sum s]
    sp: int = 1  # sequence-parallel size: the ranks of the replica's group each run 1/sp of every row
    # Per stage, how many of its transformer layers run under ``recompute`` (pyramid checkpointing;
    # the others keep their activations); () = every layer, as whole-stage recompute modes do.
    checkpointed: tuple[int, ...] = ()
    extrapolated: bool = False  # priced beyond what the cost model measured (only when extrapolation is allowed)
    # Per link s -> s+1, the bytes sent (and the gradient returned) where stages send different
    # tensors (encoder-decoder pipelines); () = ``activation_bytes`` on every link.
    link_bytes: tuple[float, ...] = ()
    # Split backward, per stage (() = not priced: the backward stays whole): the part of
    # ``backward_ms`` that computes weight gradients (W; the rest, I, computes the stage input's
    # gradient and sends it upstream), and the bytes held from I's end until W ends in place of
    # ``stored_bytes`` (every saved tensor and one gradient per linear layer's output).
    weight_ms: tuple[float, ...] = ()
    deferred_bytes: tuple[float, ...] = ()

    @property
    def local_shape(self) -> tuple[int, int]:
        """(rows, row length / sp): what each rank of the group holds, sends and receives."""
        return self.shape[0], self.shape[1] // self.sp

    @property
    def real_tokens(self) -> int:
        """Tokens of the sequences themselves, padding excluded."""
        return sum(self.seq_lens)

    @property
    def token_slots(self) -> int:
        """Positions of the token tensor (rows x row length): real tokens plus padding."""
        return self.shape[0] * self.shape[1]

    @property
    def time_ms(self) -> float:
        """Forward + backward on the slowest stage."""
        return max(f + b for f, b in zip(self.forward_ms, self.backward_ms))


@dataclass(frozen=True)
class PairMicroBatch(MicroBatch):
    """A micro-batch of (input, target) pairs for an encoder-decoder model: ``seq_lens`` and
    ``shape`` are the input side's (padded [n, Se]), ``target_lens`` and ``target_shape`` the
    target side's (padded [n, Sd])."""

    target_lens: tuple[int, ...] = ()
    target_shape: tuple[int, int] = (0, 0)

    @property
    def real_tokens(self) -> int:
        return sum(self.seq_lens) + sum(self.target_lens)

    @property
    def token_slots(self) -> int:
        return self.shape[0] * self.shape[1] + self.target_shape[0] * self.target_shape[1]


@dataclass(frozen=True)
class Op:
    """One compute step of a schedule: forward ("F") or backward ("B") of micro-batch ``mb``, or
    the backward split in two (zero-bubble schedules): "I", the gradient of the stage's input (sent
    upstream at once), and "W", the gradient of its weights, which may run later."""

    kind: str  # "F" | "B" | "I" | "W"
    mb: int


@dataclass(frozen=True)
class Schedule:
    """Per pipeline stage, the order in which it runs forwards and backwards of its micro-batches.

    ``name`` says which policy produced it (e.g. "1f1b", "adaptive", "zero_bubble"); ``order`` is
    the micro-batch order it was built from.
    """

    name: str
    order: tuple[int, ...]
    stages: tuple[tuple[Op, ...], ...]

    @property
    def split(self) -> bool:
        """Whether some backward runs split into I and W."""
        return any(op.kind == "W" for stage in self.stages for op in stage)


@dataclass(frozen=True)
class LinkSpec:
    """Point-to-point link between adjacent pipeline stages."""

    gb_per_s: float
    latency_us: float = 10.0

    def transfer_ms(self, nbytes: float) -> float:
        return self.latency_us / 1e3 + nbytes / (self.gb_per_s * 1e9) * 1e3


@dataclass(frozen=True)
class SimResult:
    makespan_ms: float
    bubble_fraction: float  # idle share of stage-time: 1 - busy / (stages * makespan)
    peak_bytes: tuple[float, ...]  # per stage: model states excluded, activations only
    events: tuple = field(default=(), repr=False)  # (stage, stream, name, start_ms, end_ms) for traces


@dataclass(frozen=True)
class ReplicaPlan:
    """One pipeline replica: ``size`` neighbouring data-parallel columns from column ``first``
    (a sequence-parallel group; DynaPipe's replicas are one column wide) running its ordered
    micro-batches through every stage, each row split over the group's ranks."""

    micro_batches: tuple[MicroBatch, ...]
    schedule: Schedule
    sim: SimResult
    first: int = 0
    size: int = 1
    tp: int = 1  # tensor-parallel ranks per stage (pipelines of a simulated strategy may differ)

    @property
    def gpus(self) -> int:
        return self.size * self.tp * len(self.schedule.stages)

    @property
    def columns(self) -> range:
        return range(self.first, self.first + self.size)


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step of the whole cluster: a pipeline plan per replica; the replicas' columns
    tile the data-parallel columns in order (aligned power-of-two groups)."""

    method: str
    layout: Layout
    replicas: tuple[ReplicaPlan, ...]
    update_ms: float = 0.0  # after every replica's pipeline drains: all-reduce + optimizer step
    candidate: str = "dynapipe"  # the plugin's plans: which candidate won (its own, or a baseline's)

    @property
    def iteration_ms(self) -> float:
        return max(r.sim.makespan_ms for r in self.replicas) + self.update_ms

    @property
    def micro_batches(self) -> list[MicroBatch]:
        return [mb for r in self.replicas for mb in r.micro_batches]

    @property
    def num_columns(self) -> int:
        """The data-parallel columns the replicas tile (a replica's own are ``ReplicaPlan.columns``)."""
        return sum(r.size for r in self.replicas)

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return tuple(r.size for r in self.replicas)

    @property
    def extrapolated(self) -> int:
        """Micro-batches priced beyond what the cost model measured."""
        return sum(mb.extrapolated for mb in self.micro_batches)

    @property
    def padding_fraction(self) -> float:
        """Token slots holding padding (packed rows hold none)."""
        slots = sum(mb.token_slots for mb in self.micro_batches)
        return 1.0 - sum(mb.real_tokens for mb in self.micro_batches) / slots

    @property
    def peak_bytes(self) -> float:
        return max(max(r.sim.peak_bytes) for r in self.replicas)

    @property
    def bubble_fraction(self) -> float:
        return max(r.sim.bubble_fraction for r in self.replicas)
