"""A sharding plan as an FSDP1 auto-wrap policy.

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    model = FSDP(model, auto_wrap_policy=policy(model, plan), use_orig_params=True)

Each unit becomes its own FSDP instance with the plan's strategy: replicate -> NO_SHARD,
keep and grad_op -> SHARD_GRAD_OP (FSDP1 has no per-module "keep gathered across micro-batches":
it gathers and reduce-scatters every micro-batch), full -> FULL_SHARD, reshard -> FULL_SHARD
(FSDP1 has no integer reshard; logged once). With ``plan.shard_size`` below the world size,
sharded units are hybrid: sharded inside groups of ``shard_size`` consecutive ranks and
replicated across them (HYBRID_SHARD, _HYBRID_SHARD_ZERO2), over process groups built once.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import CustomPolicy

from ..plan.sharding.shard_plan import ShardPlan
from .targets import wrap_targets

logger = logging.getLogger(__name__)

STRATEGY = {
    "replicate": ShardingStrategy.NO_SHARD,
    "keep": ShardingStrategy.SHARD_GRAD_OP,
    "grad_op": ShardingStrategy.SHARD_GRAD_OP,
    "full": ShardingStrategy.FULL_SHARD,
    "reshard": ShardingStrategy.FULL_SHARD,
}
HYBRID = {
    ShardingStrategy.SHARD_GRAD_OP: ShardingStrategy._HYBRID_SHARD_ZERO2,
    ShardingStrategy.FULL_SHARD: ShardingStrategy.HYBRID_SHARD,
}
_warned: set[str] = set()


def policy(model: nn.Module, plan: ShardPlan, *, process_group: dist.ProcessGroup | None = None) -> CustomPolicy:
    """The FSDP1 ``auto_wrap_policy`` of ``plan`` for ``model`` (whose planned linears it splits in place).

    ``process_group``: the ranks the plan was searched for (default: the world)."""
    world = dist.get_world_size(process_group)
    targets = wrap_targets(model, plan, world)
    if any(t.choice.kind == "reshard" for t in targets) and "reshard" not in _warned:
        _warned.add("reshard")
        logger.warning(
            "FSDP1 has no integer reshard_after_forward: 'reshard' units run FULL_SHARD (they gather "
            "over all %d ranks in backward); use FSDP2 (apply_fully_shard) for the planned choice",
            plan.shard_size,
        )
    groups = hybrid_groups(plan.shard_size, process_group) if plan.shard_size < world else None
    kwargs: dict[int, dict[str, Any]] = {}
    for t in targets:
        strategy = STRATEGY[t.choice.kind]
        if strategy is ShardingStrategy.NO_SHARD or groups is None:
            kwargs[id(t.module)] = {"sharding_strategy": strategy, "process_group": process_group}
        else:
            kwargs[id(t.module)] = {"sharding_strategy": HYBRID[strategy], "process_group": groups}
    return CustomPolicy(lambda m: kwargs.get(id(m), False))


def hybrid_groups(
    shard_size: int, process_group: dist.ProcessGroup | None = None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(intra, inter) for hybrid sharding: this rank's group of ``shard_size`` consecutive ranks
    (parameters sharded over it) and its group of the ranks holding the same shard (replicas).
    Every rank creates every group, as ``new_group`` requires."""
    ranks = (
        dist.get_process_group_ranks(process_group) if process_group is not None else list(range(dist.get_world_size()))
    )
    me = dist.get_rank()
    intra = inter = None
    for start in range(0, len(ranks), shard_size):
        group = dist.new_group(ranks[start : start + shard_size])
        if me in ranks[start : start + shard_size]:
            intra = group
    for offset in range(shard_size):
        group = dist.new_group(ranks[offset::shard_size])
        if me in ranks[offset::shard_size]:
            inter = group
    return intra, inter
