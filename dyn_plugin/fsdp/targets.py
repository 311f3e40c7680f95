"""What a sharding plan wraps: each unit's module and the choice it runs, root last.

Both FSDP paths (policy.py for FSDP1, fully_shard.py for FSDP2) start here, so they check a plan
the same way and cut the same linears: a plan made for another model, another world size or
another precision is refused before anything is wrapped, and every ``split`` unit is replaced
by its ``SplitLinear`` whose first ``sharded`` slices run ``full`` and the rest ``keep``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..device import DTYPE_NAMES
from ..models.shard_units import unit_modules
from ..models.split_linear import split_linear
from ..plan.sharding.shard_plan import Choice, ShardPlan


@dataclass(frozen=True)
class Target:
    """One module to wrap and the (non-split) choice it runs."""

    name: str  # qualified name; a split unit's slices are "<unit>.slices.<i>"
    module: nn.Module
    choice: Choice


def wrap_targets(model: nn.Module, plan: ShardPlan, world: int) -> list[Target]:
    """The modules to wrap, bottom-up (units in plan order, slices of a split unit each on their
    own), the root last. Splits the planned linears of ``model`` in place."""
    modules = unit_modules(model)
    plan.check_units([*modules, ""])
    plan.check_world(world)
    dtypes = {DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in model.parameters()}
    if dtypes != {plan.dtype}:
        raise ValueError(
            f"sharding plan was priced in {plan.dtype} but the model's parameters are "
            f"{', '.join(sorted(dtypes))}: cast the model to {plan.dtype} or search the plan in its precision"
        )
    targets, root = [], []
    for unit in plan.units:
        choice = unit.choice
        if choice.kind == "reshard" and not (
            choice.reshard_to < plan.shard_size and plan.shard_size % choice.reshard_to == 0
        ):
            raise ValueError(
                f"unit {unit.name!r}: reshard({choice.reshard_to}) must be a divisor of shard_size "
                f"{plan.shard_size} other than 1 and itself (FSDP2's integer reshard_after_forward)"
            )
        if unit.name == "":
            if choice.kind == "split":
                raise ValueError("the root unit '' cannot be split: it is not one linear layer")
            root = [Target("", model, choice)]
        else:
            if choice.kind == "split":
                split_linear(model, unit.name, choice.slices)
            targets += unit_targets(model, unit.name, choice)
    return targets + root


def unit_targets(model: nn.Module, name: str, choice: Choice) -> list[Target]:
    """What one (non-root) unit wraps: its module, or each slice of its split."""
    module = model.get_submodule(name)
    if choice.kind != "split":
        return [Target(name, module, choice)]
    return [
        Target(f"{name}.slices.{i}", part, Choice("full" if i < choice.sharded else "keep"))
        for i, part in enumerate(module.slices)
    ]
