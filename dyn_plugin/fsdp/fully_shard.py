"""A sharding plan applied with FSDP2's ``fully_shard``, unit by unit, bottom-up.

    apply_fully_shard(model, plan)          # then build the optimizer on model.parameters()

Per unit: ``reshard_after_forward`` False for keep and grad_op, True for full, the integer
``reshard_to`` for reshard; split units' slices run full or keep. ``keep`` also stays gathered
between micro-batches and accumulates unsharded gradients: the training entry (train.py)
switches ``set_reshard_after_backward`` and ``set_requires_gradient_sync`` off on those units
(``held_units``) for every micro-batch but a step's last. ``replicate`` is FSDP2 on a
(world, 1) mesh: a shard dimension of one rank, so the parameters stay whole and the gradients
are all-reduced over the replicate dimension (probed on torch 2.13: units on this mesh and on
the plan's own mesh mix in one model, and train exactly). With ``plan.shard_size`` below the
world, the plan's mesh is 2-D (replicate, shard): HSDP.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from ..plan.sharding.shard_plan import Choice, ShardPlan
from .targets import unit_targets, wrap_targets

HELD = ("keep", "replicate")  # units whose gradients are reduced once per step, not per micro-batch
MESH_DIMS = ("replicate", "shard")


def plan_mesh(plan: ShardPlan, device_type: str | None = None) -> DeviceMesh:
    """The plan's data-parallel mesh: 1-D over the world, or 2-D (replicas, shard_size) for hybrid sharding."""
    device_type = device_type or _device_type()
    if plan.shard_size == plan.world:
        return init_device_mesh(device_type, (plan.world,))
    return init_device_mesh(device_type, (plan.replicas, plan.shard_size), mesh_dim_names=MESH_DIMS)


def apply_fully_shard(model: nn.Module, plan: ShardPlan, *, mesh: DeviceMesh | None = None) -> FSDPModule:
    """Apply ``plan`` to ``model`` in place (planned linears split first); returns the root FSDP module.

    ``mesh``: the plan's mesh if already built (1-D of ``plan.world`` ranks, or 2-D with a shard
    dimension of ``plan.shard_size``)."""
    world = dist.get_world_size()
    targets = wrap_targets(model, plan, world)
    mesh = mesh or plan_mesh(plan)
    shard = mesh.size(mesh.ndim - 1)
    if mesh.size() != plan.world or shard != plan.shard_size:
        raise ValueError(
            f"mesh of shape {tuple(mesh.shape)} does not fit the plan: it needs {plan.world} ranks with a "
            f"shard dimension of {plan.shard_size}; pass no mesh to have it built"
        )
    replicated = None
    for t in targets:
        if t.choice.kind == "replicate":
            # one mesh for all replicated units, built only if the plan has any (every rank builds it)
            replicated = replicated or init_device_mesh(mesh.device_type, (world, 1), mesh_dim_names=MESH_DIMS)
            fully_shard(t.module, mesh=replicated, reshard_after_forward=False)
        else:
            fully_shard(t.module, mesh=mesh, reshard_after_forward=reshard_after_forward(t.choice))
    return model


def reshard_after_forward(choice: Choice) -> bool | int:
    """FSDP2's ``reshard_after_forward`` for a (non-split) choice."""
    if choice.kind == "reshard":
        return choice.reshard_to
    return choice.kind == "full"


def held_units(model: nn.Module, plan: ShardPlan) -> list[FSDPModule]:
    """The FSDP modules of ``model`` (after ``apply_fully_shard``) that stay gathered, and keep
    unsharded gradients, across a step's micro-batches: keep and replicate units, keep slices."""
    held = [
        t.module for u in plan.units for t in unit_targets(model, u.name, u.choice) if u.name and t.choice.kind in HELD
    ]
    root = plan.choices()[""]
    return held + [model] if root.kind in HELD else held


def _device_type() -> str:
    """The device the default process group's backend communicates on."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"
