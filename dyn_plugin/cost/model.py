"""The cost-model protocol every planner calls, and the micro-batch features it is built on.

A micro-batch on one pipeline stage costs forward time, backward time, activation memory kept
until backward ("stored") and the peak while it runs. Every implementation reduces a
micro-batch to two features of its sequence lengths:

- ``slots``: token slots the kernels run over (real tokens plus padding);
- ``attn``: query-key pairs, the quadratic term: n*S^2 for a padded [n, S] block, sum(s_i^2)
  for a packed row with per-document attention.

Linear layers scale with ``slots``, attention with ``attn``; that is what makes packing and
padding comparable under one model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, Sequence, runtime_checkable

Layout = Literal["padded", "packed"]
Recompute = Literal["none", "selective", "full"]
LAYOUTS: tuple[Layout, ...] = ("padded", "packed")
RECOMPUTES: tuple[Recompute, ...] = ("none", "selective", "full")
COMPONENTS = ("embedding", "layer", "head")
METRICS = ("forward_ms", "backward_ms", "stored_bytes", "peak_bytes")


# The head's activations per token and entry of the (tensor-parallel rank's share of the)
# vocabulary, (stored for backward, peak), by the loss that runs: transformers' loss saves its fp32
# log-softmax and at its peak holds the logits, that copy and its gradient (measured on torch's
# CPU kernels, fp32 and bf16 alike); Megatron's vocab-parallel cross-entropy on the logits upcast
# to fp32 saves the fp32 softmax, computed in place, next to the 16-bit logits.
HF_LOSS_BYTES = (4, 12)
MEGATRON_LOSS_BYTES = (4, 6)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class Features:
    slots: float  # token slots the kernels run over: real tokens plus padding
    attn: float
    max_len: int


def tensor_shape(seq_lens: Sequence[int], layout: Layout, pad_multiple: int = 8, sp: int = 1) -> tuple[int, int]:
    """(rows, row length) of a micro-batch's token tensors: the one definition the planner prices
    and writes into plans, the collate builds and pipeline engines size their receive buffers by.

    padded: one row per sequence, each right-padded to the longest rounded up to ``pad_multiple``;
    packed: one row of exactly the real tokens, no fill (per-document attention needs none).
    With sequence parallelism over ``sp`` ranks the row length is rounded up to a multiple of
    ``sp`` (packed rows by a padding document) and each rank holds ``row length / sp`` of it.
    """
    if len(seq_lens) == 0:
        raise ValueError("a micro-batch needs at least one sequence")
    if min(seq_lens) <= 0:
        raise ValueError(f"sequence lengths must be positive, got {min(seq_lens)}")
    if sp < 1 or sp & (sp - 1):
        raise ValueError(f"a sequence-parallel size must be a power of two, got {sp}")
    if layout == "padded":
        return len(seq_lens), round_up(round_up(max(seq_lens), pad_multiple), sp)
    if layout == "packed":
        return 1, round_up(int(sum(seq_lens)), sp)
    raise ValueError(f"layout must be 'padded' or 'packed', got {layout!r}")


def features(seq_lens: Sequence[int], layout: Layout, pad_multiple: int = 8, sp: int = 1) -> Features:
    """Token slots and attention pairs of one micro-batch in the given layout, per rank of its
    sequence-parallel group: the slots are exactly those of its tensors (:func:`tensor_shape`)
    over ``sp``, and each rank computes 1/sp of the attention (Ulysses: all positions of 1/sp of
    the heads; ring: its queries against every key). ``max_len`` stays the longest sequence,
    which the attention kernel still spans."""
    rows, width = tensor_shape(seq_lens, layout, pad_multiple, sp)
    if layout == "padded":
        return Features(slots=float(rows * width) / sp, attn=float(rows * width * width) / sp, max_len=width)
    fill = width - sum(seq_lens)  # the padding document, a causal block of its own
    return Features(
        slots=float(width) / sp, attn=float(sum(x * x for x in seq_lens) + fill * fill) / sp, max_len=max(seq_lens)
    )


@dataclass(frozen=True)
class StageSpec:
    """What one pipeline stage holds: a run of transformer layers, maybe the embedding and the head."""

    num_layers: int
    first: bool = True
    last: bool = True

    @property
    def held(self) -> str:
        """Its layers in words, as errors name a stage."""
        return f"{self.num_layers} layers"


def split_layers(num_layers: int, stages: int) -> list[StageSpec]:
    """Layers spread as evenly as possible over ``stages`` (earlier stages take the remainder)."""
    if stages < 1 or stages > num_layers:
        raise ValueError(f"cannot split {num_layers} layers over {stages} pipeline stages")
    base, extra = divmod(num_layers, stages)
    return [StageSpec(base + (i < extra), first=i == 0, last=i == stages - 1) for i in range(stages)]


@dataclass(frozen=True)
class MicroBatchCost:
    forward_ms: float
    backward_ms: float
    stored_bytes: float  # activations kept from forward until backward
    peak_bytes: float  # activation peak while this micro-batch runs (includes its stored bytes)
    extrapolated: bool = False  # outside the measured range (only when extrapolation is allowed)

    @property
    def time_ms(self) -> float:
        return self.forward_ms + self.backward_ms


@dataclass(frozen=True)
class ModelStateBytes:
    params: float
    grads: float
    optimizer: float
    # alive only in the optimizer step, when no activation is: the fp32 copy of the gradients the
    # step works on under mixed precision (DeepSpeed's and torch's AMP optimizers alike)
    update: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def update_peak(self) -> float:
        """What the device holds during the optimizer step."""
        return self.total + self.update


class OutOfProfileRange(ValueError):
    """A query the measurements do not cover; planners treat it as infeasible."""


@runtime_checkable
class CostModel(Protocol):
    """What planners need to know about one model on one device."""

    num_layers: int

    def micro_batch_cost(
        self,
        seq_lens: Sequence[int],
        *,
        layout: Layout,
        recompute: Recompute = "none",
        tp: int = 1,
        stage: StageSpec | None = None,
    ) -> MicroBatchCost:
        """Cost of one micro-batch on one stage (the whole model when ``stage`` is None)."""
        ...

    def model_state_bytes(
        self, *, stage: StageSpec | None = None, zero_stage: int = 0, dp: int = 1, tp: int = 1
    ) -> ModelStateBytes:
        """Parameters, gradients and optimizer state one device holds for ``stage``."""
        ...


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter for weights, gradients and Adam state under a training precision."""

    param: int
    grad: int
    optimizer: int
    update: int = 0  # the step's fp32 copy of the gradients of the optimizer's partition

    @classmethod
    def of(cls, dtype: str) -> "Precision":
        if dtype == "fp32":
            return cls(param=4, grad=4, optimizer=8)  # Adam m and v
        if dtype in ("fp16", "bf16"):
            return cls(param=2, grad=2, optimizer=12, update=4)  # fp32 master copy + m + v
        raise ValueError(f"dtype must be one of fp32, fp16, bf16; got {dtype!r}")


def zero_sharded_states(num_params: float, precision: Precision, zero_stage: int, dp: int) -> ModelStateBytes:
    """ZeRO memory per device: stage 1 shards optimizer state, 2 also gradients, 3 also weights."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3; got {zero_stage}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1; got {dp}")
    return ModelStateBytes(
        params=num_params * precision.param / (dp if zero_stage >= 3 else 1),
        grads=num_params * precision.grad / (dp if zero_stage >= 2 else 1),
        optimizer=num_params * precision.optimizer / (dp if zero_stage >= 1 else 1),
        update=num_params * precision.update / (dp if zero_stage >= 1 else 1),
    )
