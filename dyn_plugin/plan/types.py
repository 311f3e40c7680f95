"""The plan dataclasses every planner produces and every runtime piece consumes."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..cost.model import Layout, Recompute


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
class Op:
    """One compute step of a schedule: forward ("F") or backward ("B") of micro-batch ``mb``."""

    kind: str  # "F" | "B"
    mb: int


@dataclass(frozen=True)
class Schedule:
    """Per pipeline stage, the order in which it runs forwards and backwards of its micro-batches.

    ``name`` says which policy produced it (e.g. "1f1b", "adaptive"); ``order`` is the
    micro-batch order it was built from.
    """

    name: str
    order: tuple[int, ...]
    stages: tuple[tuple[Op, ...], ...]


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
