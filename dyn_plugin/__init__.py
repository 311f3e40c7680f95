"""dyn-plugin: per-step planning for variable-length training inside DeepSpeed, Megatron and FSDP.

The hosts are entered through their own packages: ``deepspeed_ext`` (``initialize``, ``train_step``),
``dyn_plugin.fsdp`` (the same two for plain PyTorch FSDP) and ``megatron_patches`` (a launcher
flag). This package re-exports the few names a user touches around them; everything else is
internal. The names load on first use, so ``import dyn_plugin`` (and the CLI) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from .version import __version__

# public name -> the module that defines it
_EXPORTS = {
    "ConfigError": "dyn_plugin.config",
    "LoadedConfig": "dyn_plugin.config",
    "load_config": "dyn_plugin.config",
    "DynLoader": "dyn_plugin.runtime.loader",
    "Step": "dyn_plugin.runtime.loader",
    "ShardPlan": "dyn_plugin.plan.sharding.shard_plan",
}

__all__ = ["__version__", "native_available", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dyn_plugin' has no attribute {name!r}")


def native_available() -> bool:
    """Whether the C++ hot paths (csrc/) are built and in use."""
    from .cost.native import core

    return core is not None
