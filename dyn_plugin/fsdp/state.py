"""What the plugin keeps for each model ``dyn_plugin.fsdp.initialize`` sharded: the sharding plan it
runs and the learning-rate scheduler its steps advance. Kept in a map keyed weakly by the model, not
as attributes stuck onto it (as ``dyn_plugin.host.recompute`` keeps its switches): the entry goes
when the model does."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..plan.sharding.shard_plan import ShardPlan


@dataclass(frozen=True)
class ModelState:
    shard_plan: ShardPlan
    scheduler: Any = None  # stepped after every optimizer step, as DeepSpeed steps its engine's


_STATES: "weakref.WeakKeyDictionary[nn.Module, ModelState]" = weakref.WeakKeyDictionary()


def remember(model: nn.Module, state: ModelState) -> None:
    _STATES[model] = state


def state_of(model: nn.Module) -> ModelState:
    """What ``initialize`` built around ``model``; a model it did not shard is refused by name."""
    state = _STATES.get(model)
    if state is None:
        raise ValueError(
            f"{type(model).__name__} was not sharded by dyn_plugin.fsdp.initialize: train the model it returned"
        )
    return state


def scheduler_of(model: nn.Module) -> Any:
    """The scheduler ``initialize`` built for ``model``; None where it built none or did not shard it
    (a model sharded by hand checkpoints its own scheduler, passed by name)."""
    state = _STATES.get(model)
    return state.scheduler if state else None


def shard_plan_of(model: nn.Module) -> ShardPlan:
    """The per-module sharding plan ``model`` runs (``dyn_plugin.fsdp.initialize`` searched or took it)."""
    return state_of(model).shard_plan
