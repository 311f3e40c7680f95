"""Sequence parallelism in DeepSpeed, data-parallel or pipelined: a group of ranks per micro-batch.

DeepSpeed sees plain data parallelism over every rank (its ``sequence_parallel_size`` stays 1):
a plan groups neighbouring ranks into aligned power-of-two sequence-parallel groups per
micro-batch, each rank of a group runs its shard of every row (the loader cut it), and attention
spans the group through the plugin's ``dyn_varlen`` kernel. Each rank's loss is the sum of its
shard's token losses; since every rank's parameters take part in its whole group's loss (through
the attention collectives), the gradients summed over all ranks are those of the global batch's
summed loss, and the usual scale dp / (global scored tokens) keeps the update its exact token
mean whatever the grouping.

``SequenceRuntime.micro_batch`` is entered around a micro-batch's forward and backward: the
group's shard for attention (recompute in backward re-runs it with this group, not whichever is
current later) and a random stream seeded per group and micro-batch, so dropout draws the same
on every rank of the group and again after a resume. The pipeline engine (pipe_engine.py) enters
``running`` around each stage's forward and backward of a micro-batch, with that stage's group.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch

from dyn_plugin.config import SequenceParallelConfig
from dyn_plugin.cost.sequence_parallel import attention_kind, group_sizes
from dyn_plugin.models.sequence_parallel import SequenceShard, sharded
from dyn_plugin.models.varlen_attention import register
from dyn_plugin.runtime.loader import Step
from dyn_plugin.runtime.sequence_groups import SequenceGroups, group_rng, group_seed


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


def use_plugin_attention(model: torch.nn.Module) -> None:
    """Make a transformers model attend through ``dyn_varlen``, the kernel that spans a group."""
    if not getattr(model, "_supports_attention_backend", False) or not hasattr(model, "config"):
        raise ValueError(
            f"sequence_parallel.enabled needs a transformers model whose attention goes through "
            f"transformers' AttentionInterface (_supports_attention_backend): {type(model).__name__} "
            "does not, so its attention could not span a sequence-parallel group; disable "
            "sequence_parallel or use such a model"
        )
    model.config._attn_implementation = register()


class SequenceRuntime:
    """Built once per run, after the process group: every aligned group, and per size the attention kind."""

    def __init__(
        self,
        config: SequenceParallelConfig,
        *,
        columns: int,
        stages: int,
        num_heads: int,
        num_kv_heads: int | None,
        seed: int,
        device: torch.device,
    ) -> None:
        self.groups = SequenceGroups(columns, stages, config.sizes)  # collective: every rank, same order
        self.kinds = {
            k: attention_kind(k, config.attention, num_heads, num_kv_heads)
            for k in group_sizes(columns, config.sizes)
            if k > 1
        }
        self.seed, self.device = seed, device

    def shard(self, stage: int, size: int, first: int, index: int, positions: torch.Tensor) -> SequenceShard | None:
        """Shard ``index`` of a micro-batch on the group of ``size`` columns from ``first`` at pipeline
        ``stage`` (None on a group of one); ``positions``: the whole rows' position ids, on the device."""
        if size == 1:
            return None
        return SequenceShard(self.groups.group(stage, first, size), size, index, self.kinds[size], positions)

    @contextlib.contextmanager
    def running(self, step: Step, mb: int, stage: int, shard: SequenceShard | None) -> Iterator[None]:
        """Around the forward and the backward of ``step``'s micro-batch ``mb`` (an index into its
        plan's micro-batches) at pipeline ``stage``: attention over ``shard``'s group, random
        numbers from the group's stream."""
        seed = group_seed(self.seed, step.epoch, step.index, mb, step.plan.micro_batches[mb].group, stage)
        with group_rng(seed, self.device), sharded(shard):
            yield

    @contextlib.contextmanager
    def micro_batch(self, step: Step, i: int, batch: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Around entry ``i`` of ``step.micro_batches`` (``batch``): its forward and its backward."""
        size, first, index = step.shards[i]
        positions = batch["sequence_position_ids"].to(self.device) if size > 1 else None
        with self.running(step, step.plan.loads[i], 0, self.shard(0, size, first, index, positions)):
            yield


def sequence_runtime(engine: Any, step: Step) -> SequenceRuntime | None:
    """The engine's sequence-parallel runtime (None without ``sequence_parallel.enabled``)."""
    sequence = getattr(engine, "_dyn_plugin_sequence", None)
    # the plan's micro-batches, not the loaded ones: a pipeline's middle stages load none
    if sequence is None and any(d.sp > 1 for d in step.plan.micro_batches):
        raise ValueError(
            f"step {step.index} splits micro-batches over sequence-parallel groups, but this engine was "
            "not initialized with sequence_parallel.enabled (deepspeed_ext.initialize builds the groups)"
        )
    return sequence
