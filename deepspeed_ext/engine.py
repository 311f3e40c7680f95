"""``deepspeed_ext.initialize``: the plugin's checks, loader and (with pipelines) engine around
``deepspeed.initialize``."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from typing import Any, Mapping, Sequence

import torch

from deepspeed_ext.sequence_parallel import check_deepspeed_config
from deepspeed_ext.state import EngineState, remember
from deepspeed_ext.zero3 import merge_zero_config, zero3_settings
from dyn_plugin.config import LoadedConfig, load_config
from dyn_plugin.cost.encoder_decoder import EncoderDecoderCostModel
from dyn_plugin.cost.from_config import live_cost_model, model_shape
from dyn_plugin.cost.table import TableCostModel
from dyn_plugin.device import rank_device, training_dtype
from dyn_plugin.host import support
from dyn_plugin.host.encoder_decoder import pair_inputs
from dyn_plugin.host.exactness import checked
from dyn_plugin.host.sequence_parallel import SequenceRuntime
from dyn_plugin.layout import RankLayout
from dyn_plugin.models.hf import is_encoder_decoder
from dyn_plugin.plan.sharding.shard_plan import ShardPlan
from dyn_plugin.profiling.allocator import stable_cpu_allocator
from dyn_plugin.runtime.loader import DynLoader

logger = logging.getLogger(__name__)


def skip_cpu_shm_build() -> None:
    """Skip the shared-memory op DeepSpeed JIT-compiles on CPU at init (40-90 s); gloo does
    the collectives either way. Patch the module itself: ``deepspeed.comm.torch`` as an
    attribute is the torch module, so patching through it would silently do nothing."""
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def _dtype_mismatch(what: str, dtype: str, ds_dtype: str, fix: str) -> ValueError:
    section = {
        "bf16": "bf16.enabled is true",
        "fp16": "fp16.enabled is true",
        "fp32": "neither bf16.enabled nor fp16.enabled is true",
    }[ds_dtype]
    return ValueError(
        f"{what} is {dtype!r} but the DeepSpeed config trains in {ds_dtype} ({section}): the plan would "
        f"price activations and memory in the wrong precision; {fix}"
    )


def cost_model_for(cfg: LoadedConfig, model: torch.nn.Module) -> TableCostModel:
    """The config's cost model, in the precision DeepSpeed trains in."""
    cm = cfg.plugin.cost_model
    ds_dtype = training_dtype(cfg.deepspeed)
    if "dtype" in cm.model_fields_set and cm.dtype != ds_dtype:
        raise _dtype_mismatch(
            "dyn_plugin.cost_model.dtype",
            cm.dtype,
            ds_dtype,
            f"set it to {ds_dtype!r} or leave it out (it follows the DeepSpeed config)",
        )
    cm = cm.model_copy(update={"dtype": ds_dtype})  # set: a profile measured in another precision is refused
    return live_cost_model(cm, cfg.plugin.cluster, model_shape(model))


def _deepspeed_config(ds: dict[str, Any], dp: int) -> dict[str, Any]:
    ds = dict(ds)
    for key, value in (
        ("train_micro_batch_size_per_gpu", 1),
        ("gradient_accumulation_steps", 1),
        ("train_batch_size", dp),
    ):
        if key in ds and ds[key] != value:
            logger.info("dyn_plugin plans micro-batches per step: %s %s -> %s", key, ds[key], value)
        ds[key] = value
    return ds


def initialize(
    *,
    model: torch.nn.Module,
    config: str | os.PathLike | Mapping[str, Any] | LoadedConfig,
    dataset: Sequence[Any],
    lengths: Sequence[int],
    optimizer: Any = None,
    model_parameters: Any = None,
    lr_scheduler: Any = None,
    cost_model: TableCostModel | EncoderDecoderCostModel | None = None,
    seed: int = 0,
    shard_plan: ShardPlan | None = None,
):
    """``deepspeed.initialize`` with the plugin's loader; returns (engine, optimizer, loader, scheduler).

    An encoder-decoder (T5) trains on (input, target) pairs: ``lengths`` of shape [N, 2], dataset
    items with ``input_ids`` and ``labels``, and an encoder-decoder ``cost_model`` (or the config's
    ``cost_model.profile`` naming tables of pairs: ``cost.from_config.pair_cost_model``); data-parallel,
    or in a pipeline of encoder stages then decoder stages (``seq2seq_pipe``).

    ``shard_plan``: a sharding plan to apply under ZeRO-3 instead of the one ``sharding.plan`` names."""
    import deepspeed
    import torch.distributed as dist

    cfg = config if isinstance(config, LoadedConfig) else load_config(config)
    pp = cfg.plugin.pipeline.stages
    # what this host runs of the plugin's features (dyn_plugin/host/support.py), all refused at once
    support.check(
        "DeepSpeed pipeline" if pp > 1 else "DeepSpeed",
        support.Run(cfg.plugin, cfg.zero_stage, is_encoder_decoder(model), training_dtype(cfg.deepspeed)),
    )
    if is_encoder_decoder(model):  # before the layouts: theirs are a decoder-only model's
        cost_model = pair_inputs(model, lengths, cost_model, cfg.plugin.cost_model, training_dtype(cfg.deepspeed))
    if cost_model is not None and cost_model.dtype != training_dtype(cfg.deepspeed):
        raise _dtype_mismatch(
            "the cost_model argument's dtype",
            cost_model.dtype,
            training_dtype(cfg.deepspeed),
            "build it (or measure its profile) in the precision DeepSpeed trains in",
        )
    sp = cfg.plugin.sequence_parallel
    if sp.enabled:
        check_deepspeed_config(cfg.deepspeed)
    if shard_plan is not None and not cfg.plugin.sharding.enabled:
        raise ValueError(
            "a shard_plan was given but dyn_plugin.sharding.enabled is false; set it to true to apply the plan"
        )
    if not torch.cuda.is_available():
        # the allocator the CPU profile was measured under (dyn_plugin/cost/allocator.py)
        stable_cpu_allocator()
    # also where the user initialized torch.distributed: DeepSpeed's own communicator (the pipeline
    # engine's) is set up only by its init_distributed, which leaves an existing process group as it is
    deepspeed.init_distributed()
    # the plugin's kernel where plans need it, the layouts priced, the start-up check (alike on every rank)
    cfg = checked(model, cfg)
    rank = dist.get_rank()
    layout = RankLayout.from_config(dist.get_world_size(), cfg.plugin)  # refuses stages that do not divide the world
    dp = layout.columns
    stage, column, _ = layout.coords(rank)  # stage-major, as DeepSpeed's PipeDataParallelTopology lays ranks out
    ds_config = _deepspeed_config(cfg.deepspeed, dp)
    cost = cost_model or cost_model_for(cfg, model)
    state_bytes = None
    if cfg.plugin.sharding.enabled:
        shard_plan, mapping = _apply_sharding(cfg, model, shard_plan, cost, lengths, seed, rank)
        ds_config = merge_zero_config(ds_config, mapping)
        # what ZeRO-3 really holds under the mapping (not the plan's ideal), plus the room the plan keeps
        # clear beside its states (planner_state_bytes)
        state_bytes = mapping.memory_bytes + shard_plan.planning_state_bytes - shard_plan.state_bytes
    loader = DynLoader(
        dataset,
        lengths=lengths,
        config=cfg,
        cost_model=cost,
        layout=layout,
        stage=stage,
        column=column,
        seed=seed,
        state_bytes=state_bytes,
    )
    shape = model_shape(model) if sp.enabled else None  # a pipeline's module below has no config
    swap = contextlib.nullcontext()
    if pp > 1:
        from deepspeed.pipe import PipelineModule

        from deepspeed_ext.pipe_engine import PlanPipelineEngine
        from deepspeed_ext.pipe_module import causal_lm_pipe

        stages = loader.context.spec.stages
        if isinstance(model, PipelineModule):
            logger.warning(
                "using the given PipelineModule as it is: its stages should hold the layers the planner prices: %s",
                stages,
            )
        elif is_encoder_decoder(model):
            from deepspeed_ext.seq2seq_pipe import seq2seq_pipe

            model = seq2seq_pipe(model, stages)  # encoder stages then decoder stages, at the plan's split
        else:
            counts = [s.num_layers for s in stages]
            if cfg.plugin.start_check.enabled:
                _check_stages(model, counts)
            model = causal_lm_pipe(model, counts)
        swap = _engine_class(deepspeed, PlanPipelineEngine)
    with swap:
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=model_parameters or model.parameters(),
            lr_scheduler=lr_scheduler,
            config=ds_config,
            dist_init_required=False,
        )
    sequence = None
    if sp.enabled:
        sequence = SequenceRuntime(
            sp,
            columns=dp,
            stages=pp,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            seed=seed,
            device=engine.device,
        )
    remember(engine, EngineState(shard_plan if cfg.plugin.sharding.enabled else None, sequence))
    return engine, optimizer, loader, scheduler


def _check_stages(model: torch.nn.Module, counts: list[int]) -> None:
    """The start-up check of the pipeline's stages (``pipe_module.stage_difference``), alike on every rank."""
    from deepspeed_ext.pipe_module import stage_difference
    from dyn_plugin.host.exactness import ExactnessError, family, timed
    from dyn_plugin.host.exchange import gather

    found, ms = timed(stage_difference, model, counts)
    found = next((f for f in gather(found) if f is not None), None)
    logger.info("start-up check of %s's pipeline stages %s: %s (%.0f ms)", family(model), counts, found or "exact", ms)
    if found is not None:
        raise ExactnessError(
            f"{family(model)}: {found}; the stage builder (deepspeed_ext/pipe_module.py) does not do what this "
            "family's forward does there: train it without pipeline stages (pipeline.stages 1), or pass a "
            f"PipelineModule of your own (the start-up check against the model's own forward, tolerance "
            f"{found.tolerance:g} per token; start_check.enabled)"
        )


def _apply_sharding(
    cfg: LoadedConfig,
    model: torch.nn.Module,
    plan: ShardPlan | None,
    cost: TableCostModel,
    lengths: Sequence[int],
    seed: int,
    rank: int,
):
    """The run's plan (given, ``sharding.plan``, or searched with ZeRO-3's semantics; the same on
    every rank) and its ZeRO-3 settings; what ZeRO-3 loses is logged."""
    from dyn_plugin.models.shard_units import shard_units
    from dyn_plugin.runtime.sharding import shard_plan_for_run

    # the device this rank's engine will use: before deepspeed.initialize no one has set the current
    # device, and NCCL needs each rank's broadcast on its own GPU
    device = rank_device()
    plan = shard_plan_for_run(
        shard_units(model),
        cfg.plugin,
        cost,
        lengths,
        host="zero3",
        device=device,
        model=type(model).__name__,
        seed=seed,
        plan=plan,
    )
    mapping = zero3_settings(model, plan)
    if rank == 0:
        for line in mapping.lost:
            logger.warning("sharding plan under ZeRO-3: %s", line)
    return plan, mapping


@contextlib.contextmanager
def _engine_class(deepspeed, cls):
    """``deepspeed.initialize`` builds ``PipelineEngine`` by name with no factory hook: swap the
    name for the call, so DeepSpeed's own config and optimizer set-up build the plugin's engine."""
    saved = deepspeed.PipelineEngine
    deepspeed.PipelineEngine = cls
    try:
        yield
    finally:
        deepspeed.PipelineEngine = saved
