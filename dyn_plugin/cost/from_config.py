"""The cost model a config asks for."""

from __future__ import annotations

import os
from typing import Any

from ..config import ClusterConfig, CostModelConfig, ModelShape
from .table import TableCostModel


def build_cost_model(cfg: CostModelConfig, cluster: ClusterConfig) -> TableCostModel:
    """``kind: profile``: a profile file, or the name of one bundled with the plugin
    (``a100-gpt-6.7b``), which must have been measured in ``cfg.dtype`` when the config sets it;
    ``kind: analytic``: the model shape on the cluster's device, in ``cfg.dtype``."""
    if cfg.kind == "analytic":
        from .analytic import analytic_cost_model

        if cfg.model is None:
            raise ValueError(
                "dyn_plugin.cost_model.model is required for kind='analytic' (hidden_size, num_layers, ...)"
            )
        return analytic_cost_model(cfg.model, cluster.device, cfg.dtype)
    from .bundled import load_bundled, names
    from .profile import cost_model_from_profile, load_profile

    if os.path.exists(cfg.profile):
        profile = load_profile(cfg.profile)
    elif cfg.profile in names():
        profile = load_bundled(cfg.profile)
    else:
        raise ValueError(
            f"dyn_plugin.cost_model.profile = {cfg.profile!r}: no such file, and not a bundled profile "
            f"({', '.join(names())}); write one with `dynplugin profile`"
        )
    # A profile prices the precision it was measured in; a run in another one needs its own.
    if "dtype" in cfg.model_fields_set and profile.model.dtype != cfg.dtype:
        raise ValueError(
            f"dyn_plugin.cost_model.profile {cfg.profile!r} was measured in {profile.model.dtype} (its model.dtype), "
            f"but dyn_plugin.cost_model.dtype is {cfg.dtype!r}: measure a profile in {cfg.dtype} with "
            f"`dynplugin profile`, or train in {profile.model.dtype}"
        )
    return cost_model_from_profile(profile, allow_extrapolation=cfg.allow_extrapolation)


def model_shape(model: Any) -> ModelShape:
    """The analytic cost model's view of a transformers model, from its ``config`` (read only)."""
    c = model.config
    hidden = getattr(c, "hidden_size", None) or c.n_embd
    return ModelShape(
        hidden_size=hidden,
        num_layers=getattr(c, "num_hidden_layers", None) or c.n_layer,
        num_heads=getattr(c, "num_attention_heads", None) or c.n_head,
        num_kv_heads=getattr(c, "num_key_value_heads", None),
        ffn_hidden_size=getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden,
        vocab_size=c.vocab_size,
        gated_mlp=getattr(c, "model_type", "") in ("llama", "mistral", "qwen2"),
    )


def live_cost_model(cfg: CostModelConfig, cluster: ClusterConfig, model: Any) -> TableCostModel:
    """``build_cost_model`` for a live transformers model: an analytic model without a shape takes
    the model's, and a profile that does not record the attention widths takes them from it."""
    if cfg.kind == "analytic" and cfg.model is None:
        cfg = cfg.model_copy(update={"model": model_shape(model)})
    cost = build_cost_model(cfg, cluster)
    if cost.hidden_size is None or cost.num_heads is None:
        shape = model_shape(model)
        cost.hidden_size = cost.hidden_size or shape.hidden_size
        if cost.num_heads is None:
            cost.num_heads, cost.num_kv_heads = shape.num_heads, shape.num_kv_heads
    return cost
