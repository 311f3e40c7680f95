"""The cost model a config asks for: a decoder-only model's (``build_cost_model``) or an
encoder-decoder's tables of pairs (``pair_cost_model``)."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..config import ClusterConfig, CostModelConfig, ModelShape
from .bundled import PAIR_TABLES
from .encoder_decoder import EncoderDecoderCostModel, import_t5_tables, read_pair_tables
from .shape import describe, differences, shape_from_config
from .table import TableCostModel

logger = logging.getLogger(__name__)
# what a T5 layer's cost depends on, beyond depth: tables that record their model must have these of the model trained
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
    from .bundled import load_bundled, names
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
    """Whether ``path`` is a file of encoder-decoder tables (decoder rows), not a profile."""
    try:
        return os.path.isfile(path) and bool(read_pair_tables(path))
    except (OSError, ValueError):
        return False  # load_profile says what is wrong with it


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
    try:
        raw = read_pair_tables(path, "dyn_plugin.cost_model.profile")
    except ValueError as exc:
        raise ValueError(f"{exc}; {fix}") from None
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
        # the measured config as the trained model's config class reads it (its defaults filled in)
        was = type(model_config)(**{k: v for k, v in measured.items() if k != "model_type"})
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
