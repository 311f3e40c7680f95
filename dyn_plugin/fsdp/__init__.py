"""Host adapter for plain PyTorch FSDP: a sharding plan (plan/sharding/shard_plan.py) delivered as an
FSDP1 auto-wrap policy (policy.py) or FSDP2 ``fully_shard`` calls (fully_shard.py), and a thin
training entry with the plugin's loader: ``initialize`` (engine.py) and ``train_step`` (step.py), as
in deepspeed_ext."""

from .checkpoint import load_checkpoint, save_checkpoint
from .engine import initialize
from .fully_shard import apply_fully_shard, held_units, plan_mesh
from .policy import hybrid_groups, policy
from .state import shard_plan_of
from .step import train_step

__all__ = [
    "policy",
    "hybrid_groups",
    "apply_fully_shard",
    "plan_mesh",
    "held_units",
    "initialize",
    "train_step",
    "shard_plan_of",
    "save_checkpoint",
    "load_checkpoint",
]
