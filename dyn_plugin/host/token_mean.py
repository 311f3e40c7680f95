"""The exact token-mean step over one rank's planned micro-batches, for every host.

The plan cuts a global batch into micro-batches of different token counts, so averaging their
mean losses would weight tokens unequally. Each micro-batch's summed token loss is scaled by
dp / (scored tokens of the whole global batch) instead; the host averages gradients over its dp
data-parallel ranks, so the update is that of the global batch's token-mean loss whatever the
plan (sizes, layouts, counts per rank, sequence-parallel shards).

What differs between hosts is passed in (``HostHooks``): DeepSpeed sets its accumulation boundary,
calls ``engine.backward(..., scale_wrt_gas=False)`` and ``engine.step()`` and runs each
micro-batch in its sequence-parallel context; FSDP turns gradient sync of its held units on for
the last micro-batch, calls ``loss.backward()`` and ``optimizer.step()`` + ``zero_grad``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from ..models.recompute import RecomputeSwitch, planned_layers
from ..runtime.collate import MODEL_KEYS, scored_tokens
from ..runtime.loader import Step
from .clock import PeakMemory, StepClock
from .feed import DeviceFeed


def _no_context(index: int, tensors: dict[str, torch.Tensor]) -> ContextManager[None]:
    """No context around a micro-batch: hosts without sequence-parallel groups (FSDP)."""
    return contextlib.nullcontext()


@dataclass(frozen=True)
class HostHooks:
    """What one host does around the shared loop.

    ``forward(**inputs)`` returns the model output (with ``.loss``, the mean over scored tokens,
    or a shard's summed loss under sequence parallelism); ``boundary(last)`` runs before each
    micro-batch (``last``: its backward must synchronise gradients); ``backward(scaled_loss)`` and
    ``optimizer_step()`` are the host's own; ``micro_batch(i, tensors)`` is the context micro-batch
    ``i``'s forward and backward run in."""

    forward: Callable[..., Any]
    device: torch.device
    recompute: RecomputeSwitch
    boundary: Callable[[bool], None]
    backward: Callable[[torch.Tensor], None]
    optimizer_step: Callable[[], None]
    micro_batch: Callable[[int, dict[str, torch.Tensor]], ContextManager[Any]] = _no_context


def _loss_sum(host: HostHooks, desc: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """One micro-batch's forward: its summed token loss (a sequence-parallel shard's share of it)."""
    if desc.sp > 1:  # a shard: HF sums the loss over its labels, shifted before the split
        inputs.update(labels=inputs["shift_labels"], num_items_in_batch=1)
    # only the loss is kept: the output's logits (tokens x vocabulary) alive through backward
    # are memory the profile's peak does not include (it measured forward().loss)
    loss = host.forward(**inputs, use_cache=False).loss
    # the plan knows the count; counting the labels would read a device tensor back
    return loss if desc.sp > 1 else loss * scored_tokens(desc.seq_lens)  # HF: the mean


def token_mean_step(step: Step, host: HostHooks, dp: int, timings: list | None = None) -> float:
    """Run this rank's micro-batches of ``step``, take the optimizer step, and return the
    token-mean loss of the whole global batch (summed over the ``dp`` ranks).

    ``timings``, if given, receives (forward_ms, backward_ms) of each micro-batch and
    ("step", optimizer ms), on CUDA from events (the host's clock there times launches, not
    kernels), read after the step at the cost of one synchronisation. With online calibration
    (``step.observe``) they are recorded anyway and handed to it after the step, with the step's
    peak device memory on a GPU (None elsewhere: a CPU allocator keeps no such count)."""
    if step.observe is not None and timings is None:
        timings = []
    n = len(step.micro_batches)
    peak = PeakMemory(host.device, step.observe is not None)
    if n == 0:
        raise ValueError(f"step {step.index} gave this rank no micro-batch; every rank needs at least one")
    # On the device: NCCL all-reduces device tensors only, and a host copy per micro-batch would
    # stall the device queue; the one host read is the return value.
    total = torch.zeros((), dtype=torch.float64, device=host.device)
    feed = DeviceFeed(step.micro_batches, host.device, MODEL_KEYS)  # the next one copied while this one runs
    clock = StepClock(host.device, timings is not None)
    marks = []  # per micro-batch (start, forward done, backward done), then the optimizer step's two
    for i, (desc, mb, inputs) in enumerate(zip(step.loaded, step.micro_batches, feed)):
        host.recompute.set(desc.recompute, planned_layers(desc, stage=0))  # no pipeline: the one stage
        host.boundary(i == n - 1)
        with host.micro_batch(i, mb):
            start = clock.mark()
            loss_sum = _loss_sum(host, desc, inputs)
            forward = clock.mark()
            host.backward(loss_sum * (dp / step.scored_tokens))
        total += loss_sum.detach().double()
        marks.append((start, forward, clock.mark()))
    start = clock.mark()
    host.optimizer_step()
    if timings is not None:
        end = clock.mark()
        clock.wait()
        timings += [(clock.ms(a, b), clock.ms(b, c)) for a, b, c in marks] + [("step", clock.ms(start, end))]
        if step.observe is not None:
            step.observe(timings[-n - 1 : -1], peak.read())
    if dp > 1:
        import torch.distributed as dist

        dist.all_reduce(total)
    return float(total) / step.scored_tokens


def summed_eval_loss(step: Step, host: HostHooks) -> torch.Tensor:
    """Evaluation of one planned global batch: this rank's micro-batches forward only (no gradient,
    no recompute), their summed token loss left on the device. Summed over the steps of an
    evaluation and then over the ranks, and divided by the steps' ``scored_tokens``, it is the
    token-mean loss of the evaluation set, whatever the plan cut it into."""
    host.recompute.set("none", 0)  # nothing is stored for a backward
    total = torch.zeros((), dtype=torch.float64, device=host.device)
    with torch.no_grad():
        for i, (desc, mb, inputs) in enumerate(
            zip(step.loaded, step.micro_batches, DeviceFeed(step.micro_batches, host.device, MODEL_KEYS))
        ):
            with host.micro_batch(i, mb):
                total += _loss_sum(host, desc, inputs).double()
    return total
