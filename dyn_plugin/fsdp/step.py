"""``dyn_plugin.fsdp.train_step``: one planned step on a model sharded by FSDP.

The host core's token-mean step (dyn_plugin.host.token_mean) with FSDP's own gradient sync,
``loss.backward()`` and optimizer step: each micro-batch's summed token loss is scaled by world /
(scored tokens of the whole global batch); FSDP averages gradients over the world, so the update is
that of the global batch's token-mean loss whatever the micro-batches.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..host.recompute import recompute_switch
from ..host.token_mean import HostHooks, token_mean_step
from ..plan.sharding.shard_plan import ShardPlan
from ..runtime.loader import Step
from .fully_shard import held_units
from .state import state_of


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: Step) -> float:
    """Run this rank's micro-batches of one planned step and take the optimizer step (and the
    scheduler's, where ``initialize`` built one). ``model``: as ``initialize`` returned it.

    Returns the token-mean loss of the whole global batch (over every rank). Per micro-batch:
    the plan's recompute mode; keep and replicate units (FSDP2) stay gathered and accumulate
    unsharded gradients until the last micro-batch, whose backward reduces them once."""
    state = state_of(model)
    held = _held_units(model, state.shard_plan)

    def boundary(last: bool) -> None:
        for unit in held:
            unit.set_requires_gradient_sync(last, recurse=False)
            unit.set_reshard_after_backward(last, recurse=False)

    def optimizer_step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if state.scheduler is not None:
            state.scheduler.step()

    host = HostHooks(
        forward=model,
        device=next(model.parameters()).device,
        recompute=recompute_switch(model),
        boundary=boundary,
        backward=lambda loss: loss.backward(),
        optimizer_step=optimizer_step,
    )
    return token_mean_step(step, host, dist.get_world_size())


# per model, the plan its held units were found for and those units (kept off the model, keyed weakly)
_HELD: "weakref.WeakKeyDictionary[nn.Module, tuple[ShardPlan, list[FSDPModule]]]" = weakref.WeakKeyDictionary()


def _held_units(model: nn.Module, plan: ShardPlan) -> list[FSDPModule]:
    """FSDP2's keep and replicate units of ``model``, found once per plan; none under FSDP1, which
    reduces every unit's gradients per micro-batch."""
    cached = _HELD.get(model)
    if cached is None or cached[0] is not plan:
        cached = _HELD[model] = (plan, held_units(model, plan) if isinstance(model, FSDPModule) else [])
    return cached[1]
