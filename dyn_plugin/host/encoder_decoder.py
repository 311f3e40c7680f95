"""What every host checks before it trains an encoder-decoder: pairs to plan and a cost model that
prices them. Planned as sequences, the model would be trained on its inputs as its own targets."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..cost.encoder_decoder import EncoderDecoderCostModel


def check_pair_inputs(name: str, lengths: Any, cost_model: Any) -> None:
    """Refuse, naming the fix, an encoder-decoder ``name`` given 1-D lengths or a cost model that is
    not an encoder-decoder's."""
    if np.ndim(lengths) != 2:
        raise ValueError(
            f"{name} is an encoder-decoder: it trains on (input, target) pairs; give lengths as an [N, 2] array of "
            "(input, target) token counts (dyn_plugin.lengths.pairs) and dataset items with 'input_ids' and 'labels'"
        )
    if not isinstance(cost_model, EncoderDecoderCostModel):
        raise ValueError(
            f"{name} is an encoder-decoder: pass cost_model=, an encoder-decoder cost model "
            "(dyn_plugin.cost.encoder_decoder, e.g. import_t5_tables of measured tables); the config's cost_model "
            "section builds decoder-only cost models"
        )
