"""DeepSpeed's checkpoint plus the plugin loader's position (dyn_plugin.host.checkpoint)."""

from __future__ import annotations

import os

from dyn_plugin.device import local_rank
from dyn_plugin.host.checkpoint import read_loader_state, write_loader_state
from dyn_plugin.runtime.loader import DynLoader


def save_checkpoint(engine, loader: DynLoader, save_dir: str | os.PathLike, tag: str | None = None) -> str:
    """DeepSpeed's checkpoint plus the loader's position (as JSON beside it, not pickled).

    The loader JSON is written by every node's local rank 0 (``LOCAL_RANK``), not by global rank
    0 alone: without a shared filesystem each node then resumes from its own copy."""
    import torch.distributed as dist

    tag = tag or f"step{engine.global_steps}"
    engine.save_checkpoint(str(save_dir), tag=tag)
    if local_rank() == 0:
        write_loader_state(os.path.join(save_dir, tag), loader.state_dict())
    if dist.is_initialized():
        dist.barrier()
    return tag


def load_checkpoint(engine, loader: DynLoader, load_dir: str | os.PathLike, tag: str | None = None) -> None:
    """Restore the engine (weights, optimizer, scheduler) and the loader's position: training then
    continues with exactly the samples the interrupted epoch had left. Every rank reads the loader
    JSON from its own node's copy (see ``save_checkpoint``)."""
    path, _ = engine.load_checkpoint(str(load_dir), tag=tag)
    if path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint in {load_dir} (tag {tag or 'latest'})")
    loader.load_state_dict(read_loader_state(os.path.dirname(path) if os.path.isfile(path) else path))
