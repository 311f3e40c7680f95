"""A run's sequence-parallel groups, and what a host enters around each micro-batch that uses one.

Built once per run, after the process group, on every rank (``SequenceGroups`` creates every
group collectively); each host (DeepSpeed's engines, Megatron's schedules) enters ``running``
around a micro-batch's forward and around its backward at one pipeline stage: attention over the
micro-batch's group (``models.sequence_parallel.sharded``; recompute in backward re-runs attention
with the group of its own forward) and a random stream seeded per group and micro-batch, so
dropout draws the same on every rank of the group, again under recompute, and after a resume.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

import torch

from ..config import SequenceParallelConfig
from ..cost.sequence_parallel import attention_kind, group_sizes
from ..models.sequence_parallel import SequenceShard, sharded
from ..runtime.collate import position_ids
from ..runtime.loader import Step
from ..runtime.sequence_groups import SequenceGroups, group_rng, group_seed
from .feed import copy_to


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

    def planned_shard(self, step: Step, mb: int, stage: int) -> SequenceShard | None:
        """The shard of ``step``'s micro-batch ``mb`` (an index into its plan's micro-batches) at
        pipeline ``stage``, from the plan alone (None on a group of one): a pipeline's middle stages
        load no tokens, yet their attention needs the whole rows' positions to find the documents."""
        desc = step.plan.micro_batches[mb]
        if desc.sp == 1:
            return None
        whole = copy_to(position_ids(desc.seq_lens, desc.layout, desc.shape), self.device)
        return self.shard(stage, desc.sp, desc.group, step.plan.column - desc.group, whole)

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
        positions = copy_to(batch["sequence_position_ids"], self.device) if size > 1 else None
        with self.running(step, step.plan.loads[i], 0, self.shard(0, size, first, index, positions)):
            yield
