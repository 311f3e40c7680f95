"""``deepspeed_ext.train_step``: one planned step on a DeepSpeed engine.

Data parallel (and ZeRO): the host core's token-mean step (dyn_plugin.host.token_mean) with
DeepSpeed's accumulation boundary, backward and step. Pipelines: the plugin's
``PlanPipelineEngine`` runs the step's execution plan.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from dyn_plugin.host.recompute import recompute_switch
from dyn_plugin.host.token_mean import HostHooks, token_mean_step
from dyn_plugin.models.hf import is_encoder_decoder
from dyn_plugin.models.seq2seq import pair_forward
from dyn_plugin.runtime.loader import Step

from .sequence_parallel import sequence_runtime


def train_step(engine, step: Step, timings: list | None = None) -> float:
    """Run this rank's micro-batches of one planned step and take the optimizer step.

    Returns the token-mean loss of the whole global batch (summed over ranks). ``timings``, if
    given, receives (forward_ms, backward_ms) of each micro-batch and ("step", optimizer ms); on a
    pipeline, whose micro-batches overlap, each compute instruction of this rank as (name, start
    ms, end ms) from the step's start (``PlanPipelineEngine.train_batch``)."""
    import torch.distributed as dist

    from deepspeed_ext.pipe_engine import PlanPipelineEngine

    if isinstance(engine, PlanPipelineEngine):
        return engine.train_batch(step, timings=timings)
    dp = dist.get_world_size() if dist.is_initialized() else 1
    return token_mean_step(step, deepspeed_host(engine, step), dp, timings)


def deepspeed_host(engine, step: Step) -> HostHooks:
    """A data-parallel DeepSpeed engine as the token-mean step drives it: the plan sets the
    accumulation boundary per micro-batch, and the loss is already scaled for the whole global
    batch (``scale_wrt_gas=False``). An encoder-decoder's packed pairs run through the engine too,
    their encoder masked per pair (``models.seq2seq.pair_forward``)."""
    sequence = sequence_runtime(engine, step)

    def micro_batch(index: int, tensors: dict[str, torch.Tensor]) -> ContextManager[Any]:
        return sequence.micro_batch(step, index, tensors) if sequence else contextlib.nullcontext()

    return HostHooks(
        forward=pair_forward(engine, engine.module) if is_encoder_decoder(engine.module) else engine,
        device=engine.device,
        recompute=recompute_switch(engine.module),
        boundary=engine.set_gradient_accumulation_boundary,
        backward=lambda loss: engine.backward(loss, scale_wrt_gas=False),
        optimizer_step=engine.step,
        micro_batch=micro_batch,
    )
