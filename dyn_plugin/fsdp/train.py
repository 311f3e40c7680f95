"""A thin training entry for plain PyTorch FSDP with the plugin's loader and a sharding plan.

    model, optimizer, loader, plan = initialize(model, "config.json", dataset, lengths, plan="plan.json")
    for step in loader:
        loss = train_step(model, optimizer, step, plan)

The same exact token-mean contract as ``deepspeed_ext.train_step``: each micro-batch's summed
token loss is scaled by world / (scored tokens of the whole global batch); FSDP averages
gradients over the world, so the update is that of the global batch's token-mean loss whatever
the micro-batches. Every micro-batch's forward gathers sharded parameters, so every rank must
run the same number of micro-batches: the loader plans equal counts (``zero_stage=3``).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..config import LoadedConfig, load_config
from ..cost.from_config import live_cost_model
from ..cost.table import TableCostModel
from ..models.recompute import RecomputeSwitch, planned_layers
from ..models.shard_units import shard_units
from ..plan.shard_plan import ShardPlan
from ..profiling.allocator import stable_cpu_allocator
from ..runtime.collate import MODEL_KEYS, scored_tokens
from ..runtime.loader import DynLoader, Step
from ..runtime.sharding import shard_plan_for_run
from .fully_shard import apply_fully_shard, held_units
from .policy import policy

logger = logging.getLogger(__name__)

Host = Literal["fsdp2", "fsdp1"]


def initialize(
    model: nn.Module,
    config: str | os.PathLike | Mapping[str, Any] | LoadedConfig,
    dataset: Sequence[Any],
    lengths: Sequence[int],
    *,
    plan: ShardPlan | str | os.PathLike | None = None,
    fsdp: Host = "fsdp2",
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = torch.optim.AdamW,
    cost_model: TableCostModel | None = None,
    seed: int = 0,
) -> tuple[nn.Module, torch.optim.Optimizer, DynLoader, ShardPlan]:
    """Shard ``model`` as the plan says and build its optimizer and the plugin's loader.

    ``plan``: a ShardPlan, or the path of one (default: the config's ``dyn_plugin.sharding.plan``;
    without either, the plan is searched for the run's lengths on rank 0 and shared with every rank).
    The model trains in the precision of its parameters, which must be the plan's and the cost
    model's. On CUDA the model is moved to ``cuda:$LOCAL_RANK`` first. Returns (model, optimizer,
    loader, plan); with ``fsdp="fsdp1"`` the model is the root ``FullyShardedDataParallel``."""
    cfg = config if isinstance(config, LoadedConfig) else load_config(config)
    plugin = cfg.plugin
    if fsdp not in ("fsdp2", "fsdp1"):
        raise ValueError(f"fsdp={fsdp!r}: choose 'fsdp2' (fully_shard) or 'fsdp1' (FullyShardedDataParallel)")
    if plugin.pipeline.stages > 1 or plugin.sequence_parallel.enabled:
        raise ValueError("the FSDP entry trains data-parallel only: set dyn_plugin.pipeline.stages to 1 and "
                         "sequence_parallel.enabled to false, or train through deepspeed_ext")
    if plugin.microbatching.method != "dynapipe":
        raise ValueError(f"microbatching.method {plugin.microbatching.method!r}: sharded training needs the same number "
                         "of micro-batches on every rank (each forward gathers parameters), which only 'dynapipe' plans")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        model.to(device)
    else:
        stable_cpu_allocator()  # the allocator CPU profiles were measured under
    cost = cost_model or live_cost_model(plugin.cost_model, plugin.cluster, model)
    host = fsdp if plugin.sharding.host == "auto" else plugin.sharding.host
    plan = shard_plan_for_run(shard_units(model), plugin, cost, lengths, host=host,
                              device=next(model.parameters()).device, model=type(model).__name__, seed=seed, plan=plan)
    if plan.host != fsdp:
        logger.warning("the sharding plan was priced for %s but trains under %s: its predicted memory and "
                       "communication may not hold (search it with sharding.host = %r)", plan.host, fsdp, fsdp)
    if fsdp == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, auto_wrap_policy=policy(model, plan), use_orig_params=True,
                                         device_id=next(model.parameters()).device)  # CPU (gloo) must be named
    else:
        apply_fully_shard(model, plan)
    optimizer = optimizer_fn(model.parameters())
    # micro-batches are cut for the memory the plan's model states leave
    loader = DynLoader(dataset, lengths=lengths, config=plugin, cost_model=cost, dp_rank=rank, dp_size=world,
                       zero_stage=3, seed=seed, state_bytes=plan.planning_state_bytes)
    return model, optimizer, loader, plan


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: Step, plan: ShardPlan) -> float:
    """Run this rank's micro-batches of one planned step and take the optimizer step.

    Returns the token-mean loss of the whole global batch (over every rank). Per micro-batch:
    the plan's recompute mode; keep and replicate units (FSDP2) stay gathered and accumulate
    unsharded gradients until the last micro-batch, whose backward reduces them once."""
    world = dist.get_world_size()
    n = len(step.micro_batches)
    if n == 0:
        raise ValueError(f"step {step.index} gave this rank no micro-batch; every rank needs at least one")
    device = next(model.parameters()).device
    # on the device: NCCL reduces device tensors only, and a host read per micro-batch would
    # stall the device queue; the one host read is the return value
    total = torch.zeros((), dtype=torch.float64, device=device)
    recompute = _recompute_switch(model)
    held = _held_units(model, plan)
    for i, (desc, mb) in enumerate(zip(step.loaded, step.micro_batches)):
        recompute.set(desc["recompute"], planned_layers(desc, stage=0))
        last = i == n - 1
        for unit in held:
            unit.set_requires_gradient_sync(last, recurse=False)
            unit.set_reshard_after_backward(last, recurse=False)
        inputs = {k: v.to(device) for k, v in mb.items() if k in MODEL_KEYS}
        # only the loss is kept: the output's logits (tokens x vocabulary) alive through backward
        # are memory the profile's peak does not include (it measured forward().loss)
        loss = model(**inputs, use_cache=False).loss
        loss_sum = loss * scored_tokens(desc["seq_lens"])  # HF returns the mean; the plan knows the count
        (loss_sum * (world / step.scored_tokens)).backward()
        total += loss_sum.detach().double()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if world > 1:
        dist.all_reduce(total)
    return float(total) / step.scored_tokens


def _held_units(model: nn.Module, plan: ShardPlan) -> list[FSDPModule]:
    """FSDP2's keep and replicate units of ``model``, found once per plan; none under FSDP1, which
    reduces every unit's gradients per micro-batch."""
    cached = getattr(model, "_dyn_plugin_held", None)
    if cached is None or cached[0] is not plan:
        cached = model._dyn_plugin_held = (plan, held_units(model, plan) if isinstance(model, FSDPModule) else [])
    return cached[1]


def _recompute_switch(model: nn.Module) -> RecomputeSwitch:
    """One switch per model: it flips the decoder layers between recompute modes."""
    switch = getattr(model, "_dyn_plugin_recompute", None)
    if switch is None:
        switch = model._dyn_plugin_recompute = RecomputeSwitch(model)
    return switch
