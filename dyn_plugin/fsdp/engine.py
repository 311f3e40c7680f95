"""``dyn_plugin.fsdp.initialize``: a sharding plan applied to plain PyTorch FSDP, the optimizer and
the plugin's loader.

    model, optimizer, loader, plan = fsdp.initialize(model, "config.json", dataset, lengths, plan="plan.json")
    for step in loader:
        loss = fsdp.train_step(model, optimizer, step, plan)

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

logger = logging.getLogger(__name__)

Host = Literal["fsdp2", "fsdp1"]


def initialize(
    model: nn.Module,
    config: str | os.PathLike | Mapping[str, Any] | LoadedConfig,
    dataset: Sequence[Any],
    lengths: Sequence[int] | Sequence[Sequence[int]],
    *,
    plan: ShardPlan | str | os.PathLike | None = None,
    fsdp: Host = "fsdp2",
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = torch.optim.AdamW,
    cost_model: TableCostModel | EncoderDecoderCostModel | None = None,
    seed: int = 0,
) -> tuple[nn.Module, torch.optim.Optimizer, DynLoader, ShardPlan]:
    """Shard ``model`` as the plan says and build its optimizer and the plugin's loader.

    ``plan``: a ShardPlan, or the path of one (default: the config's ``dyn_plugin.sharding.plan``;
    without either, the plan is searched for the run's lengths on rank 0 and shared with every rank).
    The model trains in the precision of its parameters, which must be the plan's and the cost
    model's. On CUDA the model is moved to ``cuda:$LOCAL_RANK`` first. Returns (model, optimizer,
    loader, plan); with ``fsdp="fsdp1"`` the model is the root ``FullyShardedDataParallel``."""
    cfg = config if isinstance(config, LoadedConfig) else load_config(config)
    if fsdp not in ("fsdp2", "fsdp1"):
        raise ValueError(f"fsdp={fsdp!r}: choose 'fsdp2' (fully_shard) or 'fsdp1' (FullyShardedDataParallel)")
    if is_encoder_decoder(model):  # before the layouts: theirs are a decoder-only model's
        cost_model = _check_encoder_decoder(cfg, model, lengths, cost_model)
    plugin = cfg.plugin
    if plugin.pipeline.stages > 1 or plugin.sequence_parallel.enabled:
        raise ValueError(
            "the FSDP entry trains data-parallel only: set dyn_plugin.pipeline.stages to 1 and "
            "sequence_parallel.enabled to false, or train through deepspeed_ext"
        )
    if plugin.microbatching.method != "dynapipe":
        raise ValueError(
            f"microbatching.method {plugin.microbatching.method!r}: sharded training needs the same number "
            "of micro-batches on every rank (each forward gathers parameters), which only 'dynapipe' plans"
        )
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
        plan=plan,
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
    optimizer = optimizer_fn(model.parameters())
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
    return model, optimizer, loader, plan


def _check_encoder_decoder(
    cfg: LoadedConfig, model: nn.Module, lengths: Sequence[Any], cost_model: Any
) -> EncoderDecoderCostModel:
    """What an encoder-decoder (T5) trains under here: (input, target) pairs planned by the pair
    planner, padded per side, with an encoder-decoder cost model (returned): the argument, else the
    config's tables in the precision of the model's parameters, which it trains in."""
    name = type(model).__name__
    model_type = getattr(model.config, "model_type", None)
    if model_type != "t5":
        raise ValueError(
            f"FSDP with an encoder-decoder of model_type {model_type!r} ({name}) is not built: its shard units are "
            "built and tested for T5 only; train it through deepspeed_ext (data parallel, ZeRO 0-3)"
        )
    if cfg.plugin.microbatching.layout == "packed":
        raise ValueError(
            f"microbatching.layout 'packed' with an encoder-decoder model ({name}): rows packed with several "
            "pairs are not built for encoder-decoder models under FSDP; set microbatching.layout to 'padded' or 'auto'"
        )
    if cfg.plugin.microbatching.method == "packing_full":
        # its micro-batches need models.seq2seq.pair_forward around the wrapped model, which the FSDP step lacks
        raise ValueError(
            f"microbatching.method 'packing_full' with an encoder-decoder model ({name}): packed pairs train under "
            "deepspeed_ext (data parallel) only; use another method under FSDP"
        )
    return pair_inputs(model, lengths, cost_model, cfg.plugin.cost_model, dtype_name(next(model.parameters()).dtype))
