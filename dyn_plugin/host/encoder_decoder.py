"""What every host checks before it trains an encoder-decoder: pairs to plan and a cost model that
prices them (the argument, or the config's tables of pairs). Planned as sequences, the model would
be trained on its inputs as its own targets."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from ..config import CostModelConfig
from ..cost.bundled import PAIR_TABLES
from ..cost.encoder_decoder import EncoderDecoderCostModel, import_t5_tables
from ..jsonfile import read_json

logger = logging.getLogger(__name__)
# what a T5 layer's cost depends on, beyond depth: a profile's model must have these of the model trained
_T5_SHAPE = (
    "d_model",
    "d_ff",
    "d_kv",
    "num_heads",
    "num_layers",
    "num_decoder_layers",
    "vocab_size",
    "feed_forward_proj",
)


def pair_inputs(
    model: Any, lengths: Any, cost_model: Any, config: CostModelConfig, dtype: str | None
) -> EncoderDecoderCostModel:
    """The cost model an encoder-decoder ``model`` is planned with: ``cost_model``, else the config's
    tables of pairs (:func:`pair_cost_model`, in the precision ``dtype`` the host trains in). Refused,
    naming the fix: 1-D lengths, and a cost model that is not an encoder-decoder's."""
    name = type(model).__name__
    if np.ndim(lengths) != 2:
        raise ValueError(
            f"{name} is an encoder-decoder: it trains on (input, target) pairs; give lengths as an [N, 2] array of "
            "(input, target) token counts (dyn_plugin.lengths.pairs) and dataset items with 'input_ids' and 'labels'"
        )
    if cost_model is None:
        return pair_cost_model(config, model.config, dtype)
    if not isinstance(cost_model, EncoderDecoderCostModel):
        raise ValueError(
            f"{name} is an encoder-decoder: pass cost_model=, an encoder-decoder cost model "
            "(dyn_plugin.cost.encoder_decoder, e.g. import_t5_tables of measured tables), or leave it out and name "
            "tables of pairs in the config (cost_model.kind 'profile', cost_model.profile a file from "
            "`dynplugin profile --model tiny-t5`, or 'a100-t5-11b')"
        )
    return cost_model


def pair_cost_model(cfg: CostModelConfig, model_config: Any, dtype: str | None = None) -> EncoderDecoderCostModel:
    """The config's cost model of an encoder-decoder: ``kind: profile`` naming tables of (input,
    target) pairs, a file ``dynplugin profile --model tiny-t5`` wrote or the bundled ``a100-t5-11b``
    (the DynaPipe artifact's T5-11B on A100s). ``model_config``: the trained model's transformers
    config; ``dtype``: the precision it trains in, where the host knows it.

    No analytic model prices an encoder-decoder, so ``kind: analytic`` is refused. Tables that record
    their model must have measured this one's shape (its layers' widths, depth and vocabulary), as a
    decoder-only profile must; tables that record none (the A100 ones) price this model's depth,
    width and vocabulary from their per-layer rows, with a warning that nothing checked them."""
    fix = (
        "set cost_model.kind to 'profile' and cost_model.profile to tables of pairs: measure this model with "
        f"`dynplugin profile --model <its config.json>` (as tiny-t5), or name a bundled one ({', '.join(PAIR_TABLES)})"
    )
    if cfg.kind != "profile":
        raise ValueError(f"dyn_plugin.cost_model.kind {cfg.kind!r}: no analytic model prices an encoder-decoder; {fix}")
    source = cfg.profile
    path = source if os.path.exists(source) else PAIR_TABLES.get(source)
    if path is None:
        raise ValueError(f"dyn_plugin.cost_model.profile = {source!r}: no such file, and not bundled tables; {fix}")
    raw = read_json(path, "dyn_plugin.cost_model.profile")
    if not isinstance(raw, dict) or not any(t.get("time_ms", {}).get("decoder.forward") for t in raw.get("tables", [])):
        raise ValueError(f"dyn_plugin.cost_model.profile {source!r} holds no decoder tables of pairs; {fix}")
    measured = raw.get("model", {}).get("config")
    if measured is None:
        logger.warning(
            "dyn_plugin.cost_model.profile %r records no model: its per-layer rows price the model trained (%s "
            "encoder and %s decoder layers of width %s) unchecked; measure this model with `dynplugin profile` to "
            "have it checked",
            source,
            model_config.num_layers,
            model_config.num_decoder_layers,
            model_config.d_model,
        )
    else:
        from ..models.hf import hf_config

        was = hf_config(measured)
        differ = [
            f"{k} {getattr(was, k, None)} measured, {getattr(model_config, k, None)} trained"
            for k in _T5_SHAPE
            if getattr(was, k, None) != getattr(model_config, k, None)
        ]
        if differ:
            raise ValueError(
                f"dyn_plugin.cost_model.profile {source!r} was measured on another model ({'; '.join(differ)}): its "
                "costs would price the wrong model; measure this one with `dynplugin profile --model <its config.json>`"
            )
    cost = import_t5_tables(
        raw,
        encoder_layers=model_config.num_layers,
        decoder_layers=model_config.num_decoder_layers,
        hidden_size=model_config.d_model,
        vocab_size=model_config.vocab_size,
    )
    for setting, want in (
        ("dyn_plugin.cost_model.dtype is", cfg.dtype if "dtype" in cfg.model_fields_set else None),
        ("the run trains in", dtype),
    ):
        if want is not None and want != cost.dtype:
            raise ValueError(
                f"dyn_plugin.cost_model.profile {source!r} was measured in {cost.dtype}, but {setting} {want}: its "
                f"times and bytes are another precision's; measure tables in {want} with `dynplugin profile`, or "
                f"train in {cost.dtype}"
            )
    return cost
