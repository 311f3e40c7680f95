"""Megatron's forward-backward schedules, fed one planned step per call.

Megatron assumes every step runs ``num_microbatches`` micro-batches of one shape. The patched
``get_forward_backward_func`` returns the schedule Megatron would pick, wrapped: on a training call
(not ``forward_only``) of a run with planned documents it takes the next step of the plugin's
loader, hands the schedule this rank's micro-batches in the plan's order (the order of the plan's
forward passes: Megatron's 1F1B runs micro-batches in order on every stage), their count as
``num_microbatches``, and switches activation recompute per micro-batch as the plan says. Shapes
vary per micro-batch; with pipelines Megatron's own point-to-point communicator exchanges them
(``variable_seq_lengths``, turned on by the config patch). Evaluation calls and runs without
planned documents pass through untouched. A micro-batch split over a sequence-parallel group runs
its forward and its backward inside the group (``sequence_parallel.GroupedMicroBatches``). Under
``pipeline.schedule 'zero_bubble'`` the plan's own order, split backwards included, runs on the
plugin's executor instead of Megatron's 1F1B (``plan_executor``), with the same micro-batches,
forward step and loss. Without a pipeline each micro-batch's forward and backward are timed for
the online calibration (``_Timing``; runtime/calibration.py).

Loss: the plan's micro-batches differ in tokens, so Megatron's default (each micro-batch's mean,
averaged over micro-batches and ranks) would weight tokens unequally. With
``calculate_per_token_loss`` (turned on by the config patch) the loss function returns the summed
loss and its token count, and ``finalize_model_grads`` all-reduces the count over data-parallel
ranks and scales the gradients by its inverse: the update of the token mean of the whole global
batch. A loss function returning Megatron's legacy (mean, report) pair is refused: its average
over micro-batches is not the token mean.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable

from dyn_plugin.host.feed import DeviceFeed
from dyn_plugin.plan.steps.instructions import PlannedMicroBatch

from .batches import HOST_KEYS, PlannedBatches, device, megatron_batch
from .plan_executor import run_plan, runs_plans
from .registry import Patch
from .runtime import unwrap
from .sequence_parallel import GroupedMicroBatches, grouped

logger = logging.getLogger(__name__)

SCHEDULES = "megatron.core.pipeline_parallel.schedules"


def run_order(step) -> list[int]:
    """The plan's micro-batches in the order this rank runs their forward passes."""
    from dyn_plugin.plan.steps.instructions import ForwardPass

    return [i.mb for i in step.plan.instructions if isinstance(i, ForwardPass)]


def megatron_1f1b(order: list[int], stages: int, stage: int) -> list[tuple[str, int]]:
    """What megatron-core's non-interleaved 1F1B runs on ``stage``: ``min(stages - stage - 1, n)``
    warm-up forwards, forward/backward pairs, then the remaining backwards, in ``order``: the
    planner's 1F1B with no cap on the micro-batches in flight."""
    from dyn_plugin.plan.steps.schedule import one_f_one_b

    positions = one_f_one_b(len(order), stages).stages[stage]  # over positions 0 .. n - 1 of ``order``
    return [(op.kind, order[op.mb]) for op in positions]


def check_runs_as_planned(step, stages: int) -> None:
    """Refuse a step whose order on this stage is not the one Megatron's schedule will run: a plan
    is priced (time, and memory: the micro-batches in flight) as it is ordered, so running it in
    another order would break the plan's promises silently."""
    from dyn_plugin.plan.steps.instructions import BACKWARDS, BackwardPass, ForwardPass

    # a split backward's I is named as such, so that a split plan is refused as another schedule
    planned = [
        ("F" if isinstance(i, ForwardPass) else "B" if isinstance(i, BackwardPass) else "I", i.mb)
        for i in step.plan.instructions
        if isinstance(i, (ForwardPass, *BACKWARDS))
    ]
    stage = step.plan.stage
    runs = megatron_1f1b(run_order(step), stages, stage)
    if planned != runs:
        raise ValueError(
            f"step {step.index}: stage {stage}'s plan runs {planned} but Megatron's schedule runs {runs} (its 1F1B warms "
            "up min(stages - stage - 1, micro-batches) forwards): the plan was made for another schedule; under "
            "Megatron plans never cap the micro-batches in flight (pipeline.cap_in_flight false, set by "
            "megatron_patches.runtime)"
        )


def step_batches(step) -> list[tuple[int, PlannedMicroBatch, dict]]:
    """(plan index, description, Megatron batch dict) of each of this rank's micro-batches, in run order."""
    loaded = dict(zip(step.plan.loads, step.micro_batches))
    out = []
    for m in run_order(step):
        desc = step.plan.micro_batches[m]
        out.append((m, desc, megatron_batch(desc, loaded.get(m), step.plan.column - desc.group)))
    return out


class Recompute:
    """Activation recompute of one model chunk, switched per micro-batch through megatron-core's own
    settings: ``full`` recomputes the first ``checkpointed`` layers of the chunk (``block`` method:
    pyramid checkpointing), ``selective`` the core attention of every layer, ``none`` nothing. The
    transformer block reads these at forward time, and the checkpoint taken in forward is what its
    backward replays, so 1F1B's interleaving of micro-batches is safe."""

    def __init__(self, model: Any, stage: int) -> None:
        chunk = unwrap(model)  # not kept: the switch is cached under the chunk (host.recompute)
        self.config = chunk.config
        self.stage = stage
        self.attentions = [m for m in chunk.modules() if hasattr(m, "checkpoint_core_attention")]
        self.layers = self.config.num_layers  # this chunk's layers (num_layers_per_stage below)
        block = getattr(getattr(chunk, "decoder", None), "layers", None)
        if block is not None:
            self.layers = len(block)

    def set(self, desc: PlannedMicroBatch) -> None:
        from dyn_plugin.models.recompute import planned_layers

        mode = desc.recompute
        layers = planned_layers(desc, self.stage)
        c = self.config
        if mode == "full" and (layers is None or layers > 0):
            c.recompute_granularity, c.recompute_method = "full", "block"
            c.recompute_num_layers = self.layers if layers is None else layers
        else:
            c.recompute_granularity, c.recompute_method, c.recompute_num_layers = None, None, None
        for a in self.attentions:
            a.checkpoint_core_attention = mode == "selective"


def _checked_loss(loss_func: Callable) -> Callable:
    @functools.wraps(loss_func)
    def loss(*args, **kwargs):
        out = loss_func(*args, **kwargs)
        if not kwargs.get("non_loss_data") and len(out) != 3:
            raise ValueError(
                "the forward step's loss function returned (loss, report); under dyn_plugin it must "
                "return (summed loss over the loss mask, number of scored tokens, report) as Megatron's "
                "pretrain_gpt.loss_func does with --calculate-per-token-loss: a per-micro-batch mean "
                "averaged over micro-batches is not the token mean of the global batch"
            )
        return out

    return loss


def planned(schedule: Callable) -> Callable:
    """``schedule`` (a Megatron forward-backward function) run on the plugin's next step."""

    @functools.wraps(schedule)
    def forward_backward(
        *,
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        seq_length,
        micro_batch_size,
        forward_only: bool = False,
        **kwargs,
    ):
        from . import runtime

        run = runtime.RUN
        if run is None or run.documents is None or forward_only:
            return schedule(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=num_microbatches,
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                forward_only=forward_only,
                **kwargs,
            )
        if isinstance(model, (list, tuple)) and len(model) > 1:
            raise ValueError("virtual pipeline stages (several model chunks) are not planned by the plugin")
        step = run.next_step(model)
        executed = runs_plans(run)
        if not executed:
            check_runs_as_planned(step, run.loader.layout.stages)
        items = step_batches(step)
        if not items:
            raise ValueError(f"step {step.index} gave this rank no micro-batch; every replica needs at least one")
        recompute = _recompute(model, step.plan.stage)
        groups = GroupedMicroBatches(run.sequence, step, step.plan.stage) if run.sequence is not None else None
        planned_items = iter(items)
        timing = _Timing(step, run.loader.layout.stages == 1 and not executed)

        def forward_step(iterator, chunk, *args):
            m, desc, _ = next(planned_items)
            recompute.set(desc)
            timing.forward_starts(m)
            with groups.forward(m) if groups is not None else contextlib.nullcontext():
                output, loss_func = forward_step_func(iterator, chunk, *args)
            timing.forward_ends()
            return output, _checked_loss(loss_func)

        # on the device ahead of use; the longest length stays a host int (packed_seq_params)
        feed = PlannedBatches(DeviceFeed((b for _, _, b in items), device(), host_keys=HOST_KEYS))
        if executed:
            return run_plan(
                step,
                forward_step_func=forward_step,
                data_iterator=feed,
                model=model,
                chunk=unwrap(model),
                force_all_reduce=kwargs.get("force_all_reduce", False),
            )
        # seq_length / micro_batch_size are read only for fixed shapes (variable_seq_lengths is on)
        widths = [d.shape for _, d, _ in items]
        with grouped(groups):
            out = schedule(
                forward_step_func=forward_step,
                data_iterator=feed,
                model=model,
                num_microbatches=len(items),
                seq_length=max(int(w[1]) for w in widths),
                micro_batch_size=max(int(w[0]) for w in widths),
                forward_only=False,
                **kwargs,
            )
        timing.done()
        return out

    return forward_backward


class _Timing:
    """Each micro-batch's forward and backward time of a step Megatron's schedule runs without a
    pipeline, handed to the online calibration (``step.observe``) after it. Without a pipeline the
    schedule runs each micro-batch's backward right after its forward, so a backward is the time
    from its forward's end to the next forward's start; the last one's is not observed (until the
    schedule's end it holds the gradients' reduction too, which the tables do not price). With a pipeline the stages' passes interleave with
    the transfers, and nothing is timed (DeepSpeed's pipeline engine, which runs the plan's own
    instructions, times each pass apart: deepspeed_ext/pipe_engine.py)."""

    def __init__(self, step: Any, enabled: bool) -> None:
        from dyn_plugin.host.clock import PeakMemory, StepClock

        self.step = step
        self.enabled = enabled and step.observe is not None
        self.clock = StepClock(device(), self.enabled)
        self.peak = PeakMemory(device(), self.enabled)
        self.marks: list[tuple[int, Any, Any]] = []  # (plan index, forward start, forward end)

    def forward_starts(self, m: int) -> None:
        if self.enabled:
            self.marks.append((m, self.clock.mark(), None))

    def forward_ends(self) -> None:
        if self.enabled:
            m, start, _ = self.marks[-1]
            self.marks[-1] = (m, start, self.clock.mark())

    def done(self) -> None:
        if not self.enabled:
            return
        nexts = [start for _, start, _ in self.marks[1:]] + [None]
        self.clock.wait()
        times = {
            m: (self.clock.ms(start, end), None if after is None else self.clock.ms(end, after))
            for (m, start, end), after in zip(self.marks, nexts)
        }
        self.step.observe([times[m] for m in self.step.plan.loads], self.peak.read())


def _recompute(model: Any, stage: int) -> Recompute:
    """The chunk's one ``Recompute``, made at its first planned step."""
    from dyn_plugin.host.recompute import cached_switch

    return cached_switch(unwrap(model), Recompute, model, stage)


def _get_forward_backward_func(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        return planned(original(*args, **kwargs))

    return get_forward_backward_func


def schedule_patches() -> list[Patch]:
    return [
        Patch(
            "schedule.get_forward_backward_func", f"{SCHEDULES}.get_forward_backward_func", _get_forward_backward_func
        )
    ]
