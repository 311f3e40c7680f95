"""Megatron patches: the plugin's plans inside megatron-core, with the user's script unchanged.

    dynplugin megatron --dyn-plugin-config cfg.json -- pretrain_gpt.py ARGS...
    torchrun ... -m megatron_patches.launch --dyn-plugin-config cfg.json -- train.py ARGS...

or, in a script, ``import megatron_patches; megatron_patches.apply("cfg.json")`` before training.
Each patch replaces one megatron-core (or Megatron-LM) object, in one module named for its concern:

- ``cpu``: the shims megatron-core needs without CUDA (only where CUDA is absent);
- ``settings``: variable shapes and the per-token loss on every ``TransformerConfig``;
- ``arguments``: ``--dyn-plugin-config`` in Megatron-LM's ``parse_args`` (where installed);
- ``data``: the training split's documents, from megatron-core's dataset builder;
- ``batches``: every tensor-parallel rank reads its planned micro-batch (Megatron-LM's TP data path);
- ``attention``: a core attention that takes packed (THD) rows where the local one refuses them;
- ``rope``: RoPE of packed rows with their boundaries left on the device (no sync per layer);
- ``sequence_parallel``: RoPE at a shard's positions, and a split micro-batch's group around its
  backward (the plugin's sequence-parallel size per micro-batch);
- ``schedule``: every training call of the forward-backward schedules runs the next planned step
  (its micro-batches, shapes, order and recompute), with the exact token-mean loss; zero-bubble
  plans run on the plugin's executor (``plan_executor``, with ``split_linear``: not patches, the
  schedule's call goes there) in their own order, backwards split;
- ``train_state``: the loader's position is saved and restored beside Megatron's checkpoint.

Every patch is registered with the megatron-core versions it was written against; applying is
idempotent and ``revert`` restores every original.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from .registry import Patch, Registry, UnsupportedVersion

__all__ = ["apply", "apply_cpu_shims", "revert", "patches", "Patch", "Registry", "UnsupportedVersion"]

_REGISTRY: Registry | None = None


def patches() -> list[Patch]:
    """Every patch of the plugin, in the order they are applied."""
    from .arguments import arguments_patches
    from .attention import attention_patches
    from .batches import batch_patches
    from .cpu import cpu_patches
    from .data import data_patches
    from .rope import rope_patches
    from .schedule import schedule_patches
    from .sequence_parallel import sequence_parallel_patches
    from .settings import settings_patches
    from .train_state import train_state_patches

    return [
        *cpu_patches(),
        *settings_patches(),
        *arguments_patches(),
        *data_patches(),
        *batch_patches(),
        *attention_patches(),
        *rope_patches(),
        *sequence_parallel_patches(),
        *schedule_patches(),
        *train_state_patches(),
    ]


def registry() -> Registry:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = Registry()
        for p in patches():
            _REGISTRY.register(p)
    return _REGISTRY


def apply(config: str | os.PathLike | Mapping[str, Any] | None = None, *, seed: int = 0) -> list[str]:
    """Apply every patch (again: a no-op) and, with ``config`` (or ``$DYN_PLUGIN_CONFIG``), make
    it this process's run. Returns the patches applied by this call."""
    from . import runtime
    from .cpu import stub_triton_kernels

    stub_triton_kernels()
    done = registry().apply()
    if config is not None or os.environ.get(runtime.ENV):
        runtime.configure(config, seed=seed)
    return done


def apply_cpu_shims(*, sdpa_attention: bool = False) -> Registry:
    """Megatron-LM without the plugin, on CPU ranks (reference runs and baselines): only the CPU
    shims and the dataset helpers' build, nothing of the plugin's plans; with ``sdpa_attention`` also
    the plugin's core attention (torch's SDPA kernels, packed rows accepted). Returns the applied
    registry (its ``revert`` undoes them)."""
    from .attention import attention_patches
    from .cpu import cpu_patches, stub_triton_kernels
    from .data import data_patches

    stub_triton_kernels()
    chosen = [*cpu_patches(), *(p for p in data_patches() if p.name == "data.compile_helpers")]
    if sdpa_attention:
        chosen += [p for p in attention_patches() if p.name == "attention.packed_thd"]
    shims = Registry()
    for p in chosen:
        shims.register(p)
    shims.apply()
    return shims


def revert() -> list[str]:
    """Restore every original megatron-core object and forget the run."""
    from . import runtime

    runtime.RUN = None
    return registry().revert()
