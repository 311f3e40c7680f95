"""``dyn_plugin.fsdp.initialize``: a sharding plan applied to plain PyTorch FSDP, the optimizer and
the plugin's loader.

    model, optimizer, loader, scheduler = fsdp.initialize(
        model=model, config="config.json", dataset=dataset, lengths=lengths, shard_plan="plan.json")
    for step in loader:
        loss = fsdp.train_step(model, optimizer, step)

The same shape as ``deepspeed_ext.initialize``: the same keywords (the optimizer and the scheduler
as callables, built once the model is sharded), the same four results; the sharding plan that runs
is ``fsdp.shard_plan_of(model)``.

Every micro-batch's forward gathers sharded parameters, so every rank must run the same number of
micro-batches: the loader plans equal counts (``zero_stage=3``).

An encoder-decoder (T5) trains on (input, target) pairs: ``lengths`` [N, 2], dataset items with
``input_ids`` and ``labels``, an ``EncoderDecoderCostModel``; the plan is searched over its
units (a unit per T5 sublayer, priced per side; the root owns the one embedding, tied to the head)
and the pair planner cuts each global batch for the states the plan leaves.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..config import LoadedConfig, load_config
from ..cost.encoder_decoder import EncoderDecoderCostModel
from ..cost.from_config import live_cost_model, model_shape
from ..cost.table import TableCostModel
from ..device import dtype_name, rank_device
from ..host import support
from ..host.encoder_decoder import pair_inputs
from ..host.exactness import checked
from ..layout import RankLayout
from ..models.hf import is_encoder_decoder
from ..models.shard_units import shard_units
from ..plan.sharding.shard_plan import ShardPlan
from ..profiling.allocator import stable_cpu_allocator
from ..runtime.loader import DynLoader
from ..runtime.sharding import shard_plan_for_run
from .fully_shard import apply_fully_shard
from .policy import policy
from .state import ModelState, remember

logger = logging.getLogger(__name__)

Host = Literal["fsdp2", "fsdp1"]


def initialize(
    model: nn.Module,
    config: str | os.PathLike | Mapping[str, Any] | LoadedConfig,
    dataset: Sequence[Any],
    lengths: Sequence[int] | Sequence[Sequence[int]],
    *,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = torch.optim.AdamW,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    cost_model: TableCostModel | EncoderDecoderCostModel | None = None,
    seed: int = 0,
    shard_plan: ShardPlan | str | os.PathLike | None = None,
    fsdp: Host = "fsdp2",
) -> tuple[nn.Module, torch.optim.Optimizer, DynLoader, Any]:
    """Shard ``model`` as the plan says and build its optimizer, its scheduler and the plugin's loader.

    ``shard_plan``: a ShardPlan, or the path of one (default: the config's ``dyn_plugin.sharding.plan``;
    without either, the plan is searched for the run's lengths on rank 0 and shared with every rank).
    ``optimizer``: built on the sharded model's parameters; ``lr_scheduler``: built on that optimizer,
    and stepped by ``train_step`` after each optimizer step. The model trains in the precision of its
    parameters, which must be the plan's and the cost model's. On CUDA the model is moved to
    ``cuda:$LOCAL_RANK`` first. Returns (model, optimizer, loader, scheduler or None); with
    ``fsdp="fsdp1"`` the model is the root ``FullyShardedDataParallel``."""
    cfg = config if isinstance(config, LoadedConfig) else load_config(config)
    if fsdp not in ("fsdp2", "fsdp1"):
        raise ValueError(f"fsdp={fsdp!r}: choose 'fsdp2' (fully_shard) or 'fsdp1' (FullyShardedDataParallel)")
    # what this host runs of the plugin's features (dyn_plugin/host/support.py), all refused at once
    support.check(fsdp.upper(), support.Run(cfg.plugin, encoder_decoder=is_encoder_decoder(model)))
    if is_encoder_decoder(model):  # before the layouts: theirs are a decoder-only model's
        cost_model = _pair_cost_model(cfg, model, lengths, cost_model)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    # every rank alike: the plugin's kernel where plans need it, the layouts priced, the start-up check
    cfg = checked(model, cfg)
    plugin = cfg.plugin
    world, rank = dist.get_world_size(), dist.get_rank()
    if torch.cuda.is_available():
        device = rank_device()
        torch.cuda.set_device(device)
        model.to(device)
    else:
        stable_cpu_allocator()  # the allocator CPU profiles were measured under
    cost = cost_model or live_cost_model(plugin.cost_model, plugin.cluster, model_shape(model))
    host = fsdp if plugin.sharding.host == "auto" else plugin.sharding.host
    plan = shard_plan_for_run(
        shard_units(model),
        plugin,
        cost,
        lengths,
        host=host,
        device=next(model.parameters()).device,
        model=type(model).__name__,
        seed=seed,
        plan=shard_plan,
    )
    if plan.host != fsdp:
        logger.warning(
            "the sharding plan was priced for %s but trains under %s: its predicted memory and "
            "communication may not hold (search it with sharding.host = %r)",
            plan.host,
            fsdp,
            fsdp,
        )
    if fsdp == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(
            model, auto_wrap_policy=policy(model, plan), use_orig_params=True, device_id=next(model.parameters()).device
        )  # CPU (gloo) must be named
    else:
        apply_fully_shard(model, plan)
    built = optimizer(model.parameters())
    scheduler = lr_scheduler(built) if lr_scheduler is not None else None
    remember(model, ModelState(plan, scheduler))
    # micro-batches are cut for the memory the plan's model states leave
    loader = DynLoader(
        dataset,
        lengths=lengths,
        config=plugin,
        cost_model=cost,
        layout=RankLayout(world),
        column=rank,
        zero_stage=3,
        seed=seed,
        state_bytes=plan.planning_state_bytes,
    )
    return model, built, loader, scheduler


def _pair_cost_model(
    cfg: LoadedConfig, model: nn.Module, lengths: Sequence[Any], cost_model: Any
) -> EncoderDecoderCostModel:
    """What an encoder-decoder (T5) trains under here: (input, target) pairs planned by the pair
    planner, padded per side, with an encoder-decoder cost model (returned): the argument, else the
    config's tables in the precision of the model's parameters, which it trains in."""
    model_type = getattr(model.config, "model_type", None)
    if model_type != "t5":
        raise ValueError(
            f"FSDP with an encoder-decoder of model_type {model_type!r} ({type(model).__name__}) is not built: its "
            "shard units are built and tested for T5 only; train it through deepspeed_ext (data parallel, ZeRO 0-3)"
        )
    return pair_inputs(model, lengths, cost_model, cfg.plugin.cost_model, dtype_name(next(model.parameters()).dtype))
