"""The cost model a config asks for."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..config import ClusterConfig, CostModelConfig, ModelShape
from .shape import describe, differences, shape_from_config
from .table import TableCostModel

logger = logging.getLogger(__name__)


def build_cost_model(cfg: CostModelConfig, cluster: ClusterConfig, shape: ModelShape | None = None) -> TableCostModel:
    """``kind: profile``: a profile file, or the name of one bundled with the plugin
    (``a100-gpt-6.7b``), which must have been measured in ``cfg.dtype`` when the config sets it;
    ``kind: analytic``: the model shape on the cluster's device, in ``cfg.dtype``.

    ``shape`` is the model the run trains: the analytic model's when the config gives none, and
    the one a profile must have been measured on (:func:`check_profile_shape`)."""
    if cfg.kind == "analytic":
        from .analytic import analytic_cost_model

        if cfg.model is None and shape is None:
            raise ValueError(
                "dyn_plugin.cost_model.model is required for kind='analytic' (hidden_size, num_layers, ...)"
            )
        return analytic_cost_model(cfg.model or shape, cluster.device, cfg.dtype)
    from .bundled import PAIR_TABLES, load_bundled, names
    from .profile import cost_model_from_profile, load_profile

    if cfg.profile in PAIR_TABLES or _holds_pair_tables(cfg.profile):
        raise ValueError(
            f"dyn_plugin.cost_model.profile {cfg.profile!r}: tables of an encoder-decoder's (input, target) pairs, "
            "which price encoder-decoders trained on pairs (deepspeed_ext or the FSDP entry with [N, 2] lengths, "
            "`dynplugin shard --model <its config.json>`); for a decoder-only model name its profile "
            f"(`dynplugin profile`) or a bundled one ({', '.join(names())})"
        )
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
    if shape is not None:
        check_profile_shape(cfg.profile, profile.model.name, profile.model.shape, shape)
    return cost_model_from_profile(profile, allow_extrapolation=cfg.allow_extrapolation)


def _holds_pair_tables(path: str) -> bool:
    """Whether ``path`` is a JSON file of encoder-decoder tables (decoder rows), not a profile."""
    if not path.endswith(".json") or not os.path.isfile(path):
        return False
    from ..jsonfile import read_json

    try:
        raw = read_json(path, "dyn_plugin.cost_model.profile")
    except ValueError:
        return False  # load_profile says what is wrong with it
    tables = raw.get("tables") if isinstance(raw, dict) else None
    return isinstance(tables, list) and any(
        isinstance(t, dict) and isinstance(t.get("time_ms"), dict) and "decoder.forward" in t["time_ms"] for t in tables
    )


def check_profile_shape(source: str, name: str, measured: ModelShape | None, trained: ModelShape) -> None:
    """A profile prices the model it measured: its per-layer times, memory and parameters are that
    shape's. Used for another (another family's MLP, experts, heads, vocabulary or depth) it would
    price a different model without a sign, so it is refused. A profile that records no shape
    (imported tables, files before version 4) cannot be checked: it is used, with a warning."""
    if measured is None:
        logger.warning(
            "dyn_plugin.cost_model.profile %r records no model shape (imported tables, or written before profile "
            "version 4): it is used for the model trained (%s) unchecked; re-run `dynplugin profile` on this model "
            "to have it checked",
            source,
            describe(trained),
        )
        return
    diff = differences(measured, trained)
    if diff:
        raise ValueError(
            f"dyn_plugin.cost_model.profile {source!r} was measured on {name!r} ({describe(measured)}), but the "
            f"model trained is another ({describe(trained)}; {', '.join(diff)}): its costs would price the wrong "
            "model. Measure this model with `dynplugin profile --model <its config.json>`, or set "
            "cost_model.kind to 'analytic' (priced from this model's own shape)"
        )


def model_shape(model: Any) -> ModelShape:
    """The cost model's view of a transformers model, from its ``config`` (read only; cost/shape.py)."""
    return shape_from_config(model.config)


def live_cost_model(cfg: CostModelConfig, cluster: ClusterConfig, shape: ModelShape) -> TableCostModel:
    """``build_cost_model`` for the model a run trains, of ``shape`` (:func:`model_shape` of a
    transformers model; Megatron's view of its GPT): an analytic model without a shape takes it,
    a profile must have measured it, and a profile that does not record the attention widths
    takes them from it."""
    cost = build_cost_model(cfg, cluster, shape)
    cost.hidden_size = cost.hidden_size or shape.hidden_size
    if cost.num_heads is None:
        cost.num_heads, cost.num_kv_heads = shape.num_heads, shape.num_kv_heads
    return cost
