"""DeepSpeed adapter: one JSON config, the plugin's loader, exact token-weighted steps.

    import deepspeed_ext
    engine, optimizer, loader, scheduler = deepspeed_ext.initialize(
        model=model, config="ds_config.json", dataset=dataset, lengths=lengths)
    for step in loader:
        loss = deepspeed_ext.train_step(engine, step)
    deepspeed_ext.save_checkpoint(engine, loader, "checkpoints")  # DeepSpeed's, plus the loader's position
    deepspeed_ext.load_checkpoint(engine, loader, "checkpoints")  # on resume, before the loop

The plugin decides the micro-batches, so DeepSpeed is told one micro-batch per step and the
accumulation boundary is set per micro-batch from the plan; each micro-batch's summed token
loss is scaled by dp / (scored tokens of the whole global batch), so after DeepSpeed averages
gradients over data-parallel ranks the update is that of the token-mean loss of the global
batch, whatever the plan (sizes, layout, counts per rank) and for every ZeRO stage.

With ``pipeline.stages > 1`` the engine is the plugin's ``PlanPipelineEngine`` (pipe_engine.py),
which runs each step's execution plan; ``train_step`` hands it the step.

With ``sharding.enabled`` and ZeRO stage 3, the per-module sharding plan (``sharding.plan``, or the
``shard_plan`` argument) is expressed in ZeRO-3's own settings as closely as they allow (zero3.py):
its keys are merged into ``zero_optimization`` and what ZeRO-3 cannot express is logged.

With ``sequence_parallel.enabled`` a micro-batch may run on a group of neighbouring ranks, each
holding a shard of every row (sequence_parallel.py), in pipelines too (at every stage); DeepSpeed
still sees plain data parallelism.

Modules: ``engine`` (initialize), ``step`` (train_step, on the host core's token-mean step),
``checkpoint`` (save/load, the loader position beside DeepSpeed's checkpoint), ``pipe_engine``,
``pipe_module``, ``seq2seq_pipe`` (a T5 as an encoder stage then a decoder stage),
``sequence_parallel``, ``zero3``.
"""

from __future__ import annotations

from deepspeed_ext.checkpoint import load_checkpoint, save_checkpoint
from deepspeed_ext.engine import initialize, skip_cpu_shm_build
from deepspeed_ext.state import shard_plan_of
from deepspeed_ext.step import train_step
from dyn_plugin.cost.from_config import model_shape
from dyn_plugin.device import training_dtype

__all__ = [
    "initialize",
    "train_step",
    "training_dtype",
    "save_checkpoint",
    "load_checkpoint",
    "skip_cpu_shm_build",
    "shard_plan_of",
    "model_shape",
]
