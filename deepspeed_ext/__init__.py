"""DeepSpeed adapter: one JSON config, the plugin's loader, exact token-weighted steps.

    import deepspeed_ext
    engine, optimizer, loader, scheduler = deepspeed_ext.initialize(
        model=model, config="ds_config.json", dataset=dataset, lengths=lengths)
    for step in loader:
        loss = deepspeed_ext.train_step(engine, step)

The plugin decides the micro-batches, so DeepSpeed is told one micro-batch per step and the
accumulation boundary is set per micro-batch from the plan; each micro-batch's summed token
loss is scaled by dp / (scored tokens of the whole global batch), so after DeepSpeed averages
gradients over data-parallel ranks the update is that of the token-mean loss of the global
batch, whatever the plan (sizes, layout, counts per rank) and for every ZeRO stage.

With ``pipeline.stages > 1`` the engine is the plugin's ``PlanPipelineEngine`` (pipe_engine.py),
which runs each step's execution plan; ``train_step`` hands it the step.

With ``sharding.enabled`` and ZeRO stage 3, the per-module sharding plan (``sharding.plan``, or the
``shard_plan`` argument) is expressed in ZeRO-3's own settings as closely as they allow (zero3.py):
its keys are merged into ``zero_optimization`` and what ZeRO-3 cannot express is logged.

With ``sequence_parallel.enabled`` a micro-batch may run on a group of neighbouring ranks, each
holding a shard of every row (sequence_parallel.py), in pipelines too (at every stage); DeepSpeed
still sees plain data parallelism.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
from typing import Any, Mapping, Sequence

import torch

from deepspeed_ext.zero3 import merge_zero_config, zero3_settings
from dyn_plugin.config import LoadedConfig, load_config
from dyn_plugin.cost.from_config import live_cost_model, model_shape
from dyn_plugin.cost.table import TableCostModel
from dyn_plugin.plan.shard_plan import ShardPlan
from dyn_plugin.profiling.allocator import stable_cpu_allocator
from dyn_plugin.runtime.collate import MODEL_KEYS, scored_tokens
from dyn_plugin.runtime.loader import DynLoader, Step

logger = logging.getLogger(__name__)

__all__ = ["initialize", "train_step", "training_dtype", "save_checkpoint", "load_checkpoint", "skip_cpu_shm_build", "model_shape"]

LOADER_STATE = "dyn_plugin_loader.json"


def skip_cpu_shm_build() -> None:
    """Skip the shared-memory op DeepSpeed JIT-compiles on CPU at init (40-90 s); gloo does
    the collectives either way. Patch the module itself: ``deepspeed.comm.torch`` as an
    attribute is the torch module, so patching through it would silently do nothing."""
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def training_dtype(ds: Mapping[str, Any]) -> str:
    """The precision a DeepSpeed config trains in: its ``bf16`` or ``fp16`` section, else fp32."""
    if (ds.get("bf16") or ds.get("bfloat16") or {}).get("enabled", False):
        return "bf16"
    return "fp16" if (ds.get("fp16") or {}).get("enabled", False) else "fp32"


def _dtype_mismatch(what: str, dtype: str, ds_dtype: str, fix: str) -> ValueError:
    section = {"bf16": "bf16.enabled is true", "fp16": "fp16.enabled is true",
               "fp32": "neither bf16.enabled nor fp16.enabled is true"}[ds_dtype]
    return ValueError(f"{what} is {dtype!r} but the DeepSpeed config trains in {ds_dtype} ({section}): the plan would "
                      f"price activations and memory in the wrong precision; {fix}")


def _cost_model(cfg: LoadedConfig, model: torch.nn.Module) -> TableCostModel:
    """The config's cost model, in the precision DeepSpeed trains in."""
    cm = cfg.plugin.cost_model
    ds_dtype = training_dtype(cfg.deepspeed)
    if "dtype" in cm.model_fields_set and cm.dtype != ds_dtype:
        raise _dtype_mismatch("dyn_plugin.cost_model.dtype", cm.dtype, ds_dtype,
                              f"set it to {ds_dtype!r} or leave it out (it follows the DeepSpeed config)")
    cm = cm.model_copy(update={"dtype": ds_dtype})  # set: a profile measured in another precision is refused
    return live_cost_model(cm, cfg.plugin.cluster, model)


def _deepspeed_config(ds: dict[str, Any], dp: int) -> dict[str, Any]:
    ds = dict(ds)
    for key, value in (("train_micro_batch_size_per_gpu", 1), ("gradient_accumulation_steps", 1),
                       ("train_batch_size", dp)):
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
    cost_model: TableCostModel | None = None,
    seed: int = 0,
    shard_plan: ShardPlan | None = None,
):
    """``deepspeed.initialize`` with the plugin's loader; returns (engine, optimizer, loader, scheduler).

    ``shard_plan``: a sharding plan to apply under ZeRO-3 instead of the one ``sharding.plan`` names."""
    import deepspeed
    import torch.distributed as dist

    cfg = config if isinstance(config, LoadedConfig) else load_config(config)
    if cost_model is not None and cost_model.dtype != training_dtype(cfg.deepspeed):
        raise _dtype_mismatch("the cost_model argument's dtype", cost_model.dtype, training_dtype(cfg.deepspeed),
                              "build it (or measure its profile) in the precision DeepSpeed trains in")
    pp = cfg.plugin.pipeline.stages
    sp = cfg.plugin.sequence_parallel
    if sp.enabled:
        _check_sequence_parallel(cfg)
    if shard_plan is not None and not cfg.plugin.sharding.enabled:
        raise ValueError("a shard_plan was given but dyn_plugin.sharding.enabled is false; set it to true to apply the plan")
    if cfg.plugin.sharding.enabled:
        _check_sharding(cfg)
    if pp > 1 and cfg.zero_stage >= 2:
        raise ValueError(f"pipeline.stages = {pp} with zero_optimization.stage = {cfg.zero_stage}: DeepSpeed's "
                         "pipeline engine supports ZeRO stages 0 and 1 only; use ZeRO-1 with pipelines, or ZeRO-2/3 without")
    method = cfg.plugin.microbatching.method
    if cfg.zero_stage >= 2 and method != "dynapipe":
        raise ValueError(f"microbatching.method {method!r} with zero_optimization.stage = {cfg.zero_stage}: that batching "
                         "does not give every data-parallel rank the same number of micro-batches, which ZeRO-2/3 "
                         "need; use method 'dynapipe' (it plans equal counts) or ZeRO stage 0 or 1")
    if not torch.cuda.is_available():
        # the allocator the CPU profile was measured under (dyn_plugin/cost/allocator.py)
        stable_cpu_allocator()
    if not dist.is_initialized():
        deepspeed.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % pp:
        raise ValueError(f"pipeline.stages = {pp} does not divide the {world} ranks; launch a multiple of {pp} ranks")
    dp = world // pp
    stage, replica = divmod(rank, dp)  # stage-major, as DeepSpeed's PipeDataParallelTopology lays ranks out
    if sp.enabled:
        from deepspeed_ext.sequence_parallel import use_plugin_attention

        use_plugin_attention(model)
    ds_config = _deepspeed_config(cfg.deepspeed, dp)
    cost = cost_model or _cost_model(cfg, model)
    state_bytes = None
    if cfg.plugin.sharding.enabled:
        shard_plan, mapping = _apply_sharding(cfg, model, shard_plan, cost, lengths, seed, rank)
        ds_config = merge_zero_config(ds_config, mapping)
        # what ZeRO-3 really holds under the mapping (not the plan's ideal), plus the room the plan keeps
        # clear beside its states (planner_state_bytes)
        state_bytes = mapping.memory_bytes + shard_plan.planning_state_bytes - shard_plan.state_bytes
    loader = DynLoader(dataset, lengths=lengths, config=cfg, cost_model=cost, dp_rank=replica, dp_size=dp, pp_rank=stage,
                       pp_size=pp, seed=seed, state_bytes=state_bytes)
    shape = model_shape(model) if sp.enabled else None  # a pipeline's module below has no config
    swap = contextlib.nullcontext()
    if pp > 1:
        from deepspeed.pipe import PipelineModule

        from deepspeed_ext.pipe_engine import PlanPipelineEngine
        from deepspeed_ext.pipe_module import causal_lm_pipe

        planned = [s.num_layers for s in loader.context.spec.stages]
        if isinstance(model, PipelineModule):
            logger.warning("using the given PipelineModule as it is: its stages should hold %s transformer layers "
                           "(pipeline.layers_per_stage), as the planner prices them", planned)
        else:
            model = causal_lm_pipe(model, planned)
        swap = _engine_class(deepspeed, PlanPipelineEngine)
    with swap:
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, model_parameters=model_parameters or model.parameters(),
            lr_scheduler=lr_scheduler, config=ds_config, dist_init_required=False)
    engine._dyn_plugin_shard_plan = shard_plan if cfg.plugin.sharding.enabled else None  # the plan that ran
    if sp.enabled:
        from deepspeed_ext.sequence_parallel import SequenceRuntime

        engine._dyn_plugin_sequence = SequenceRuntime(sp, columns=dp, stages=pp, num_heads=shape.num_heads,
                                                      num_kv_heads=shape.num_kv_heads, seed=seed, device=engine.device)
    return engine, optimizer, loader, scheduler


def _check_sharding(cfg: LoadedConfig) -> None:
    """A sharding plan runs here only as ZeRO-3 settings."""
    if cfg.zero_stage != 3:
        raise ValueError(f"dyn_plugin.sharding.enabled with zero_optimization.stage = {cfg.zero_stage}: DeepSpeed "
                         "expresses a per-module sharding plan only under ZeRO-3; set zero_optimization.stage to 3, "
                         "or train with the FSDP entry dyn_plugin.fsdp")
    host = cfg.plugin.sharding.host
    if host not in ("auto", "zero3"):
        raise ValueError(f"dyn_plugin.sharding.host = {host!r} under DeepSpeed: plans here run as ZeRO-3 settings; set "
                         "it to 'zero3' or 'auto', or train with the FSDP entry dyn_plugin.fsdp")


def _apply_sharding(cfg: LoadedConfig, model: torch.nn.Module, plan: ShardPlan | None, cost: TableCostModel,
                    lengths: Sequence[int], seed: int, rank: int):
    """The run's plan (given, ``sharding.plan``, or searched with ZeRO-3's semantics; the same on
    every rank) and its ZeRO-3 settings; what ZeRO-3 loses is logged."""
    from dyn_plugin.models.shard_units import shard_units
    from dyn_plugin.runtime.sharding import shard_plan_for_run

    # the device this rank's engine will use: before deepspeed.initialize no one has set the current
    # device, and NCCL needs each rank's broadcast on its own GPU
    device = torch.device("cuda", _local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    plan = shard_plan_for_run(shard_units(model), cfg.plugin, cost, lengths, host="zero3", device=device,
                              model=type(model).__name__, seed=seed, plan=plan)
    mapping = zero3_settings(model, plan)
    if rank == 0:
        for line in mapping.lost:
            logger.warning("sharding plan under ZeRO-3: %s", line)
    return plan, mapping


def _check_sequence_parallel(cfg: LoadedConfig) -> None:
    from deepspeed_ext.sequence_parallel import check_deepspeed_config

    check_deepspeed_config(cfg.deepspeed)
    balance = cfg.plugin.sequence_parallel.balance
    if cfg.zero_stage >= 2 and balance == "inter":
        raise ValueError(f"sequence_parallel.balance = 'inter' with zero_optimization.stage = {cfg.zero_stage}: groups "
                         "would run different numbers of micro-batches, but ZeRO-2/3 need the same number on every "
                         "rank; use balance 'intra' or 'auto', or ZeRO stage 0 or 1")


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


def train_step(engine, step: Step, timings: list | None = None) -> float:
    """Run this rank's micro-batches of one planned step and take the optimizer step.

    Returns the token-mean loss of the whole global batch (summed over ranks). ``timings``, if
    given, receives (forward_ms, backward_ms) of each micro-batch and ("step", optimizer ms)."""
    import time

    import torch.distributed as dist

    from deepspeed_ext.pipe_engine import PlanPipelineEngine
    from dyn_plugin.models.recompute import planned_layers

    if isinstance(engine, PlanPipelineEngine):
        if timings is not None:
            raise ValueError("timings are recorded for data-parallel steps only: a pipeline's micro-batches overlap")
        return engine.train_batch(step)
    dp = dist.get_world_size() if dist.is_initialized() else 1
    n = len(step.micro_batches)
    if n == 0:
        raise ValueError(f"step {step.index} gave this rank no micro-batch; every replica needs at least one")
    # On the engine's device: NCCL all-reduces device tensors only, and a host copy per
    # micro-batch would stall the device queue; the one host read is the return value.
    total = torch.zeros((), dtype=torch.float64, device=engine.device)
    recompute = _recompute_switch(engine)
    sequence = _sequence_runtime(engine, step)
    for i, (desc, mb) in enumerate(zip(step.loaded, step.micro_batches)):
        recompute.set(desc["recompute"], planned_layers(desc, stage=0))  # no pipeline: the one stage
        engine.set_gradient_accumulation_boundary(i == n - 1)
        inputs = {k: v.to(engine.device) for k, v in mb.items() if k in MODEL_KEYS}
        if desc["sp"] > 1:  # a shard: HF sums the loss over its labels, shifted before the split
            inputs.update(labels=inputs["shift_labels"], num_items_in_batch=1)
        with sequence.micro_batch(step, i, mb) if sequence else contextlib.nullcontext():
            t0 = time.perf_counter()
            # only the loss is kept: the output's logits (tokens x vocabulary) alive through backward
            # are memory the profile's peak does not include (it measured forward().loss)
            loss = engine(**inputs, use_cache=False).loss
            # the plan knows the count; counting the labels would read a device tensor back
            loss_sum = loss if desc["sp"] > 1 else loss * scored_tokens(desc["seq_lens"])  # HF: the mean
            t1 = time.perf_counter()
            engine.backward(loss_sum * (dp / step.scored_tokens), scale_wrt_gas=False)
        total += loss_sum.detach().double()
        if timings is not None:
            timings.append(((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
    t0 = time.perf_counter()
    engine.step()
    if timings is not None:
        timings.append(("step", (time.perf_counter() - t0) * 1e3))
    if dp > 1:
        dist.all_reduce(total)
    return float(total) / step.scored_tokens


def _sequence_runtime(engine, step: Step):
    """The engine's sequence-parallel runtime (None without ``sequence_parallel.enabled``)."""
    sequence = getattr(engine, "_dyn_plugin_sequence", None)
    # the plan's micro-batches, not the loaded ones: a pipeline's middle stages load none
    if sequence is None and any(d["sp"] > 1 for d in step.plan.micro_batches):
        raise ValueError(f"step {step.index} splits micro-batches over sequence-parallel groups, but this engine was "
                         "not initialized with sequence_parallel.enabled (deepspeed_ext.initialize builds the groups)")
    return sequence


def _recompute_switch(engine):
    """One switch per engine: it flips the module's layers between recompute modes."""
    from dyn_plugin.models.recompute import RecomputeSwitch

    if getattr(engine, "_dyn_plugin_recompute", None) is None:
        engine._dyn_plugin_recompute = RecomputeSwitch(engine.module)
    return engine._dyn_plugin_recompute


def save_checkpoint(engine, loader: DynLoader, save_dir: str | os.PathLike, tag: str | None = None) -> str:
    """DeepSpeed's checkpoint plus the loader's position (as JSON beside it, not pickled).

    The loader JSON is written by every node's local rank 0 (``LOCAL_RANK``), not by global rank
    0 alone: without a shared filesystem each node then resumes from its own copy."""
    import json

    import torch.distributed as dist

    tag = tag or f"step{engine.global_steps}"
    engine.save_checkpoint(str(save_dir), tag=tag)
    if _local_rank() == 0:
        directory = os.path.join(save_dir, tag)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f"{LOADER_STATE}.tmp")
        with open(tmp, "w") as f:
            json.dump(loader.state_dict(), f)
        os.replace(tmp, os.path.join(directory, LOADER_STATE))  # a crash mid-write leaves the old file whole
    if dist.is_initialized():
        dist.barrier()
    return tag


def _local_rank() -> int:
    """This process's rank on its node: the launcher's LOCAL_RANK, else (one node) the global rank."""
    import torch.distributed as dist

    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return dist.get_rank() if dist.is_initialized() else 0


def load_checkpoint(engine, loader: DynLoader, load_dir: str | os.PathLike, tag: str | None = None) -> None:
    """Restore the engine (weights, optimizer, scheduler) and the loader's position: training then
    continues with exactly the samples the interrupted epoch had left. Every rank reads the loader
    JSON from its own node's copy (see ``save_checkpoint``)."""
    import json

    path, _ = engine.load_checkpoint(str(load_dir), tag=tag)
    if path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint in {load_dir} (tag {tag or 'latest'})")
    with open(os.path.join(os.path.dirname(path) if os.path.isfile(path) else path, LOADER_STATE)) as f:
        loader.load_state_dict(json.load(f))
