"""What the plugin keeps for each DeepSpeed engine it built: the sharding plan that ran (ZeRO-3
settings) and the run's sequence-parallel groups. Kept in a map keyed weakly by the engine, not as
attributes stuck onto DeepSpeed's object (as ``dyn_plugin.host.recompute`` keeps its switches): the
entry goes when the engine does.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from dyn_plugin.host.sequence_parallel import SequenceRuntime
from dyn_plugin.plan.sharding.shard_plan import ShardPlan


@dataclass(frozen=True)
class EngineState:
    shard_plan: ShardPlan | None = None  # the per-module sharding plan the engine runs (sharding.enabled)
    sequence: SequenceRuntime | None = None  # its sequence-parallel groups (sequence_parallel.enabled)


_STATES: "weakref.WeakKeyDictionary[Any, EngineState]" = weakref.WeakKeyDictionary()
_NONE = EngineState()


def remember(engine: Any, state: EngineState) -> None:
    """What ``deepspeed_ext.initialize`` built around ``engine``."""
    _STATES[engine] = state


def state_of(engine: Any) -> EngineState:
    """What the plugin built around ``engine`` (nothing, for an engine it did not build)."""
    return _STATES.get(engine, _NONE)


def shard_plan_of(engine: Any) -> ShardPlan | None:
    """The per-module sharding plan ``engine`` runs as ZeRO-3 settings (None without ``sharding.enabled``)."""
    return state_of(engine).shard_plan
