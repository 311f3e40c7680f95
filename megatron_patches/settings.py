"""Megatron settings the plans need, turned on wherever a ``TransformerConfig`` is built.

Megatron-LM's ``validate_args`` forces ``variable_seq_lengths`` off and leaves per-token loss off by
default; the plugin's micro-batches vary in shape (pipelines must exchange shapes) and in tokens
(the update must be the token mean: ``calculate_per_token_loss``). megatron-core refuses variable
lengths unless the MoE token dispatcher is ``alltoall``, even for dense models, so that is set too
(a dense model never dispatches). Setting these before the config's own validation means every
component built from it (the data-parallel wrapper reads ``calculate_per_token_loss`` at
construction) sees them.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

from .registry import Patch

logger = logging.getLogger(__name__)

REQUIRED = {"variable_seq_lengths": True, "calculate_per_token_loss": True}


def _post_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __post_init__(self) -> None:
        changed = [k for k, v in REQUIRED.items() if getattr(self, k) != v]
        for key, value in REQUIRED.items():
            setattr(self, key, value)
        if getattr(self, "moe_token_dispatcher_type", "alltoall") != "alltoall":
            if getattr(self, "num_moe_experts", None):
                changed.append("moe_token_dispatcher_type")
            self.moe_token_dispatcher_type = "alltoall"
        if changed:
            logger.info(
                "dyn_plugin turned on for Megatron: %s (variable micro-batch shapes, exact token-mean loss)",
                ", ".join(changed),
            )
        original(self)

    return __post_init__


def settings_patches() -> list[Patch]:
    return [
        Patch(
            "settings.transformer_config",
            "megatron.core.transformer.transformer_config.TransformerConfig.__post_init__",
            _post_init,
        )
    ]
