"""The plugin's state in one Megatron run: its config, the training documents, the loader.

``configure`` is called once per process (the launcher, or Megatron-LM's ``--dyn-plugin-config``);
the data patch hands over the training split's documents when Megatron builds its datasets; the
loader itself is built at the first planned step, when megatron-core's parallel state says which
data-parallel and pipeline rank this process is and the model says its shape.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from dyn_plugin.config import ConfigError, LoadedConfig, ModelShape, load_config
from dyn_plugin.host import checkpoint, support
from dyn_plugin.host.sequence_parallel import SequenceRuntime
from dyn_plugin.layout import RankLayout
from dyn_plugin.runtime.loader import DynLoader, Step

logger = logging.getLogger(__name__)

ENV = "DYN_PLUGIN_CONFIG"  # set by the launcher so that spawned processes configure the same run


@dataclass
class Documents:
    """Variable-length training samples: ``items[i]`` holds ``lengths[i]`` tokens."""

    items: Sequence[Any]
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


@dataclass
class PluginRun:
    config: LoadedConfig
    source: str | None = None  # the config file it was read from
    seed: int = 0
    documents: Documents | None = None
    loader: DynLoader | None = None
    sequence: SequenceRuntime | None = None  # the sequence-parallel groups, with sequence_parallel.enabled
    step: Step | None = None
    resume: Any = (
        None  # the checkpoint (dyn_plugin.host.checkpoint.Checkpoint) to continue from, until the loader exists
    )
    _steps: Iterator[Step] | None = field(default=None, repr=False)

    def set_documents(self, documents: Documents) -> None:
        if self.loader is not None:
            raise RuntimeError(
                "the training documents were set again after training started; build the training datasets once per run"
            )
        self.documents = documents
        logger.info(
            "dyn_plugin plans the %d training documents (%d tokens)", len(documents), int(documents.lengths.sum())
        )

    def restore(self, ckpt: Any) -> None:
        """Continue from a checkpoint's loader position (now, or when the loader is built)."""
        if self.loader is None:
            self.resume = ckpt
        else:
            checkpoint.restore(self.loader, ckpt)
            self._steps = None

    def next_step(self, model: Any) -> Step:
        """The next planned step (the next epoch's first when one ends)."""
        if self.loader is None:
            self.loader = build_loader(self, model)
            self.sequence = build_sequence(self, model)
            if self.resume is not None:
                checkpoint.restore(self.loader, self.resume)
                self.resume = None
        for _ in range(2):
            if self._steps is None:
                self._steps = iter(self.loader)
            step = next(self._steps, None)
            if step is not None:
                self.step = step
                return step
            self._steps = None
        raise RuntimeError(
            "the loader yielded no step in a whole epoch: the dataset has fewer tokens than one global "
            "batch (microbatching.global_tokens)"
        )


RUN: PluginRun | None = None


def configure(config: str | os.PathLike | Mapping[str, Any] | LoadedConfig | None = None, seed: int = 0) -> PluginRun:
    """Read the plugin config (default: ``$DYN_PLUGIN_CONFIG``) and make it this process's run."""
    global RUN
    config = config if config is not None else os.environ.get(ENV)
    if config is None:
        raise ConfigError(f"no dyn_plugin config: pass --dyn-plugin-config FILE (or set {ENV})")
    source = os.path.abspath(config) if isinstance(config, (str, os.PathLike)) else None
    if RUN is not None and source is not None and RUN.source == source:
        return RUN  # the launcher and Megatron-LM's --dyn-plugin-config name the same file: one run
    cfg = config if isinstance(config, LoadedConfig) else load_config(config)
    check_config(cfg)
    RUN = PluginRun(cfg, source=source, seed=seed)
    return RUN


def check_config(cfg: LoadedConfig) -> None:
    """What Megatron runs of the plugin's features (dyn_plugin/host/support.py), all refused at once."""
    support.check("megatron-core", support.Run(cfg.plugin))


def model_shape_view(model: Any) -> ModelShape:
    """A megatron-core ``GPTModel``'s shape as the plugin's cost model prices it (what
    ``dyn_plugin.cost.shape`` reads from a transformers config, here from its TransformerConfig)."""
    c = model.config
    moe: dict[str, Any] = {}
    if c.num_moe_experts:
        freq = c.moe_layer_freq  # as megatron-core's layer specs read it: every freq-th layer, or a 0/1 per layer
        pattern = [int(i % freq == 0) for i in range(c.num_layers)] if isinstance(freq, int) else list(freq)
        moe = dict(
            num_experts=c.num_moe_experts,
            experts_per_token=c.moe_router_topk,
            expert_ffn_hidden_size=c.moe_ffn_hidden_size or c.ffn_hidden_size,
            shared_expert_ffn_hidden_size=c.moe_shared_expert_intermediate_size or 0,
            dense_layers=pattern.count(0),
        )
    return ModelShape(
        hidden_size=c.hidden_size,
        num_layers=c.num_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_query_groups or c.num_attention_heads,
        head_dim=c.kv_channels,
        ffn_hidden_size=c.ffn_hidden_size,
        vocab_size=model.vocab_size,
        gated_mlp=c.gated_linear_unit,
        tied_embeddings=model.share_embeddings_and_output_weights,
        **moe,
    )


def _dtype(model: Any) -> str:
    """The precision a megatron-core model trains in (its ``params_dtype``)."""
    from dyn_plugin.device import dtype_name

    return dtype_name(model.config.params_dtype) or "fp32"


def unwrap(model: Any) -> Any:
    """The first model chunk without its DDP/Float16 wrappers."""
    chunk = model[0] if isinstance(model, (list, tuple)) else model
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def build_loader(run: PluginRun, model: Any) -> DynLoader:
    from megatron.core import parallel_state as ps

    from dyn_plugin.cost.from_config import live_cost_model

    from .plan_executor import check_model, runs_plans

    chunk = unwrap(model)
    model_type = getattr(getattr(chunk, "model_type", None), "name", None)  # Megatron-LM's get_model sets it
    if model_type == "encoder_and_decoder" or type(chunk).__name__ == "T5Model":
        raise support.refusal("encoder-decoder (input, target) pairs", "megatron-core")
    if run.documents is None:
        raise RuntimeError(
            "no training documents: the plugin takes them from megatron-core's dataset builder "
            "(BlendedMegatronDatasetBuilder(...).build()); build the training datasets with it, or call "
            "megatron_patches.runtime.RUN.set_documents(Documents(items, lengths)) before training"
        )
    if runs_plans(run):
        check_model(chunk)
    if ps.get_virtual_pipeline_model_parallel_world_size() not in (None, 1):
        raise ConfigError(
            "virtual pipeline stages (--num-layers-per-virtual-pipeline-stage) are not planned by the "
            "plugin; leave them out"
        )
    if ps.get_context_parallel_world_size() > 1:
        raise ConfigError(
            "context_parallel_size > 1: the plugin plans data-parallel and pipeline ranks only; set it to 1"
        )
    pp, dp, tp = (
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_world_size(),
        ps.get_tensor_model_parallel_world_size(),
    )
    plugin = run.config.plugin
    if plugin.pipeline.stages != pp:
        raise ConfigError(
            f"dyn_plugin.pipeline.stages = {plugin.pipeline.stages} but Megatron runs "
            f"{pp} pipeline stages (pipeline_model_parallel_size); set pipeline.stages to {pp}"
        )
    if pp > 1 and plugin.pipeline.schedule != "zero_bubble":
        # plan (and price) what Megatron's schedule runs: the plan's micro-batch order, with every
        # stage's natural warm-up (cap_in_flight is refused by the support table); memory is fit by
        # recompute. Zero-bubble plans run on the plugin's executor, in their own order.
        plugin = plugin.model_copy(update={"pipeline": plugin.pipeline.model_copy(update={"cap_in_flight": False})})
    positions = getattr(chunk, "max_sequence_length", None)
    if positions is not None and plugin.microbatching.max_seq_len > positions:
        raise ConfigError(
            f"dyn_plugin.microbatching.max_seq_len = {plugin.microbatching.max_seq_len} exceeds the model's "
            f"max_sequence_length {positions} (Megatron-LM's --seq-length / --max-position-embeddings): rows of up "
            f"to max_seq_len tokens would fail inside the model; build the model for at least that many positions, "
            f"or lower max_seq_len (with microbatching.truncate = true to cut longer documents)"
        )
    from megatron.core.models.gpt import GPTModel

    if not isinstance(chunk, GPTModel) and run.config.plugin.microbatching.may_pack:
        # megatron-core's other decoders (MambaModel's hybrids: state-space mixers outside attention)
        # are not checked to keep the documents of a packed (THD) row apart
        raise ConfigError(
            f"{type(chunk).__name__} is not megatron-core's GPTModel: the plugin's packed (THD) rows are built and "
            "checked for GPTModel's attention only, and a token mixer outside attention (a hybrid's state-space "
            "layers) would read across their documents; set dyn_plugin.microbatching.layout to 'padded'"
        )
    cm = plugin.cost_model
    dtype = _dtype(chunk)
    if "dtype" in cm.model_fields_set and cm.dtype != dtype:
        raise ConfigError(
            f"dyn_plugin.cost_model.dtype is {cm.dtype!r} but the model's params_dtype is {dtype}: set "
            f"it to {dtype!r} or leave it out (it follows the model)"
        )
    cm = cm.model_copy(update={"dtype": dtype})
    cost = live_cost_model(cm, plugin.cluster, model_shape_view(chunk))
    # the plans address (stage, data-parallel column) cells; the tp ranks of a cell share its plan,
    # each reading its own copy from a store
    loader = DynLoader(
        run.documents,
        lengths=run.documents.lengths,
        config=LoadedConfig(plugin, run.config.deepspeed),
        cost_model=cost,
        layout=RankLayout.of(dp, pp, tp),
        stage=ps.get_pipeline_model_parallel_rank(),
        column=ps.get_data_parallel_rank(),
        seed=run.seed,
        replica=ps.get_tensor_model_parallel_rank(),
    )
    block = getattr(getattr(chunk, "decoder", None), "layers", None)
    planned = loader.context.spec.stages[ps.get_pipeline_model_parallel_rank()].num_layers
    if block is not None and len(block) != planned:
        raise ConfigError(
            f"this pipeline stage holds {len(block)} transformer layers but the plan prices {planned}: set "
            "dyn_plugin.pipeline.layers_per_stage to Megatron's split, and pipeline_model_parallel_size "
            "in the model's TransformerConfig"
        )
    return loader


def build_sequence(run: PluginRun, model: Any) -> SequenceRuntime | None:
    """The run's sequence-parallel groups (None without ``sequence_parallel.enabled``): every rank
    builds every group, in the same order, at its first planned step."""
    sp = run.config.plugin.sequence_parallel
    if not sp.enabled:
        return None
    from megatron.core import parallel_state as ps

    from .batches import device
    from .sequence_parallel import check_model

    chunk = unwrap(model)
    check_model(chunk, ps.get_tensor_model_parallel_world_size())
    c = chunk.config
    return SequenceRuntime(
        sp,
        columns=ps.get_data_parallel_world_size(),
        stages=ps.get_pipeline_model_parallel_world_size(),
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_query_groups or c.num_attention_heads,
        seed=run.seed,
        device=device(),
    )
