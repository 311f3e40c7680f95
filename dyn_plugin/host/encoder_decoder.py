"""What every host checks before it trains an encoder-decoder: pairs to plan and a cost model that
prices them (the argument, or the config's tables of pairs). Planned as sequences, the model would
be trained on its inputs as its own targets."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config import CostModelConfig
from ..cost.encoder_decoder import EncoderDecoderCostModel
from ..cost.from_config import pair_cost_model


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
