"""What a packed row costs under the model's own attention, so the plan prices what runs.

The planner prices a packed row's attention per document (the sum of the documents' squared
lengths), which is what a kernel that attends within documents computes. A model attending through
transformers' SDPA or eager attention trains packed rows exactly too (transformers turns the
position-id resets into a block-causal mask), but computes the whole row's square under that mask:
a row of eight 512-token documents costs 8x what was priced. Such a model is switched to the plugin's kernel where the plans call for packed rows and its
family takes the switch (``use_document_kernel``); where it cannot, packed rows are not planned:
``microbatching.layout`` 'auto' plans padded rows, and 'packed' is refused naming both fixes.

An encoder-decoder's plans are the pair planner's, which prices a packed row of pairs over the whole
row (``cost.encoder_decoder.packed_pair_shape``), as T5 runs it (``models.seq2seq``): nothing to change.
"""

from __future__ import annotations

import logging
from typing import Any

from ..config import LoadedConfig
from ..models.hf import is_encoder_decoder
from ..models.varlen_attention import NAME, register

logger = logging.getLogger(__name__)

# attend within each document of a packed row (position-id resets), at the cost the planner prices
DOCUMENT_KERNELS = ("dyn_varlen", "flash_attention_2", "flash_attention_3")


def use_document_kernel(model: Any, cfg: LoadedConfig) -> None:
    """Where the plans call for the plugin's kernel (packed rows: layout 'packed' or 'auto', a packing
    method; sequence parallelism, whose attention spans a group) and the model attends through
    another of transformers' implementations (as ``from_pretrained`` and ``from_config`` build it:
    'sdpa'), switch it to the plugin's kernel, and log it; the family must route attention through
    transformers' AttentionInterface. Sequence parallelism needs the switch (flash-attention cannot
    span a group), and is refused where the family cannot take it."""
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    mb, sp = cfg.plugin.microbatching, cfg.plugin.sequence_parallel.enabled
    packed = mb.may_pack
    supported = attention is not None and getattr(model, "_supports_attention_backend", False)
    if sp and not supported:
        raise ValueError(
            f"sequence_parallel.enabled needs a transformers model whose attention goes through transformers' "
            f"AttentionInterface (_supports_attention_backend): {type(model).__name__} does not, so its "
            "attention could not span a sequence-parallel group; disable sequence_parallel or use such a model"
        )
    if attention is None or attention == NAME or is_encoder_decoder(model):
        return
    if not sp and (attention in DOCUMENT_KERNELS or not packed):
        return
    if not supported:
        return  # priced_layouts plans padded rows, or refuses 'packed' naming the fixes
    model.set_attn_implementation(register())
    logger.info(
        "%s attended with %r; switched to the plugin's per-document kernel %r, which %s",
        type(model).__name__,
        attention,
        NAME,
        "spans sequence-parallel groups" if sp else "runs packed rows at the cost the plan prices",
    )


def priced_layouts(model: Any, cfg: LoadedConfig) -> LoadedConfig:
    """``cfg`` with the micro-batch layouts ``model``'s attention runs at the planned cost."""
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    mb = cfg.plugin.microbatching
    if attention is None or attention in DOCUMENT_KERNELS or mb.layout == "padded" or is_encoder_decoder(model):
        return cfg
    if mb.layout == "packed" or mb.method.startswith("packing"):
        what = "microbatching.layout 'packed'" if mb.layout == "packed" else f"microbatching.method {mb.method!r}"
        raise ValueError(
            f"{what} with attn_implementation {attention!r}: a packed row then attends over the whole row under a "
            "block-causal mask (exact, but the square of the row's length) while the plan prices each document's "
            f"own square; build the model with one of {DOCUMENT_KERNELS} (dyn_plugin.models.hf.build_causal_lm "
            "defaults to 'dyn_varlen'), or set microbatching.layout to 'padded'"
        )
    logger.info(
        "dyn_plugin plans padded rows only: with attn_implementation %r a packed row would attend over the whole "
        "row (build the model with 'dyn_varlen' to plan packed rows)",
        attention,
    )
    padded = mb.model_copy(update={"layout": "padded"})
    return LoadedConfig(cfg.plugin.model_copy(update={"microbatching": padded}), cfg.deepspeed)
