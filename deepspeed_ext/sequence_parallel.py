"""Sequence parallelism in DeepSpeed, data-parallel or pipelined: a group of ranks per micro-batch.

DeepSpeed sees plain data parallelism over every rank (its ``sequence_parallel_size`` stays 1):
a plan groups neighbouring ranks into aligned power-of-two sequence-parallel groups per
micro-batch, each rank of a group runs its shard of every row (the loader cut it), and attention
spans the group through the plugin's ``dyn_varlen`` kernel. Each rank's loss is the sum of its
shard's token losses; since every rank's parameters take part in its whole group's loss (through
the attention collectives), the gradients summed over all ranks are those of the global batch's
summed loss, and the usual scale dp / (global scored tokens) keeps the update its exact token
mean whatever the grouping.

The run's groups are a ``SequenceRuntime`` (``dyn_plugin.host.sequence_parallel``, shared with
Megatron): ``train_step`` enters ``micro_batch`` around a micro-batch's forward and backward, the
pipeline engine (pipe_engine.py) ``running`` around each stage's forward and backward of a
micro-batch, with that stage's group.
"""

from __future__ import annotations

from typing import Any, Mapping

from deepspeed_ext.state import state_of
from dyn_plugin.host.sequence_parallel import SequenceRuntime
from dyn_plugin.runtime.loader import Step


def check_deepspeed_config(ds: Mapping[str, Any]) -> None:
    """The plugin forms sequence-parallel groups per micro-batch out of DeepSpeed's data-parallel
    ranks; DeepSpeed's own fixed degree would divide the data-parallel world under it."""
    size = ds.get("sequence_parallel_size", 1)
    if size != 1:
        raise ValueError(
            f"the DeepSpeed config sets sequence_parallel_size = {size}: DeepSpeed would then split the "
            "data-parallel ranks into fixed sequence-parallel groups under the plugin's plans; remove it "
            "and use dyn_plugin.sequence_parallel (the plugin picks a group size per micro-batch)"
        )


def sequence_runtime(engine: Any, step: Step) -> SequenceRuntime | None:
    """The engine's sequence-parallel runtime (None without ``sequence_parallel.enabled``)."""
    sequence = state_of(engine).sequence
    # the plan's micro-batches, not the loaded ones: a pipeline's middle stages load none
    if sequence is None and any(d.sp > 1 for d in step.plan.micro_batches):
        raise ValueError(
            f"step {step.index} splits micro-batches over sequence-parallel groups, but this engine was "
            "not initialized with sequence_parallel.enabled (deepspeed_ext.initialize builds the groups)"
        )
    return sequence
