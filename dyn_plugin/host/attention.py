"""What a packed row costs under the model's own attention, so the plan prices what runs.

The planner prices a packed row's attention per document (the sum of the documents' squared
lengths), which is what a kernel that attends within documents computes. A model attending through
transformers' SDPA or eager attention trains packed rows exactly too (transformers turns the
position-id resets into a block-causal mask), but computes the whole row's square under that mask:
a row of eight 512-token documents costs 8x what was priced. There packed rows are not planned:
``microbatching.layout`` 'auto' plans padded rows, and 'packed' is refused naming both fixes.

An encoder-decoder's plans are the pair planner's, which prices a packed row of pairs over the whole
row (``cost.encoder_decoder.packed_pair_shape``), as T5 runs it (``models.seq2seq``): nothing to change.
"""

from __future__ import annotations

import logging
from typing import Any

from ..config import LoadedConfig
from ..models.hf import is_encoder_decoder

logger = logging.getLogger(__name__)

# attend within each document of a packed row (position-id resets), at the cost the planner prices
DOCUMENT_KERNELS = ("dyn_varlen", "flash_attention_2", "flash_attention_3")


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
