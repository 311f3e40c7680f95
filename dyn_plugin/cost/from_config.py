"""The cost model a config asks for."""
from __future__ import annotations

import os

from ..config import ClusterConfig, CostModelConfig
from .table import TableCostModel


def build_cost_model(cfg: CostModelConfig, cluster: ClusterConfig) -> TableCostModel:
    """``kind: profile``: a profile file, or the name of one bundled with the plugin
    (``a100-gpt-6.7b``), which must have been measured in ``cfg.dtype`` when the config sets it;
    ``kind: analytic``: the model shape on the cluster's device, in ``cfg.dtype``."""
    if cfg.kind == "analytic":
        from .analytic import analytic_cost_model

        if cfg.model is None:
            raise ValueError("dyn_plugin.cost_model.model is required for kind='analytic' (hidden_size, num_layers, ...)")
        return analytic_cost_model(cfg.model, cluster.device, cfg.dtype)
    from ..profiles import load_bundled, names
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
