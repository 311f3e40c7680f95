"""FSDP's checkpoint under the plugin's protocol (``dyn_plugin.host.checkpoint``): whole or absent.

    tag = fsdp.save_checkpoint(model, optimizer, loader, "ckpt")
    path, client_state = fsdp.load_checkpoint(model, optimizer, loader, "ckpt")

``torch.distributed.checkpoint`` (DCP) writes the model's and the optimizer's state sharded, each rank
its own shards, as ``get_state_dict`` gives them for FSDP1 (``FullyShardedDataParallel``) and FSDP2
(``fully_shard``) alike; the scheduler's state (the one ``initialize`` built, or ``scheduler=``) and
``client_state`` ride along. DCP's ``.metadata``
makes its directory loadable but says nothing of the data: the protocol's marker, written once every
rank's files are, holds the loader's position, and the newest directory with a whole marker wins.
DCP reads every rank's shards from one directory, so every rank must see the same file system.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..host import checkpoint
from ..runtime.loader import DynLoader
from .state import scheduler_of

# client_state, and whether the optimizer had stepped, as one pickled leaf: DCP loads only the keys
# the caller's state dict names, and a resuming rank cannot name the keys of a state it has not read
EXTRA = "dyn_plugin"


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, extra: bytes) -> dict[str, Any]:
    """What DCP saves and loads in place: this rank's shards of the model and optimizer states, and
    the scheduler's.

    ``get_state_dict`` gives an optimizer that never stepped a state by stepping it (zero gradients,
    learning rate 0), which starts Adam's step count at 1: where it had not stepped, the callers clear it."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, EXTRA: extra}
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    return state


def save_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DynLoader,
    save_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    scheduler: Any = None,
    step: int | None = None,
    client_state: dict | None = None,
) -> str:
    """The sharded state of ``model`` and ``optimizer`` (FSDP1 or FSDP2), ``scheduler``'s state and
    ``client_state`` plus the loader's position, published whole in ``save_dir/tag`` (default
    ``step<step>``, else ``step<loader.position>``). Every rank calls it; returns the tag. Any rank's
    failure (DCP's own, or the protocol's) raises ``CheckpointError`` on every rank, nothing published."""
    tag = checkpoint.check_tag(tag or f"step{loader.position if step is None else step}")
    record = checkpoint.Record.of(loader)
    with checkpoint.saving(save_dir, tag, record) as save:
        stepped = bool(optimizer.state)
        extra = pickle.dumps({"client_state": client_state or {}, "stepped": stepped})
        state = _state(model, optimizer, scheduler or scheduler_of(model), extra)
        if not stepped:
            optimizer.state.clear()  # a save before the first step leaves the training as it was
        dcp.save(state, checkpoint_id=save.directory)
    return tag


def load_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DynLoader,
    load_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    scheduler: Any = None,
) -> tuple[str, dict]:
    """Restore ``model``, ``optimizer``, ``scheduler`` and the loader from the newest whole checkpoint
    under ``load_dir`` (the latest; or ``tag``, refused on every rank unless whole): training then continues with
    exactly the samples the interrupted epoch had left. The model must be sharded as when it was
    saved (the same plan: its split linears name the parameters). Returns the checkpoint's path and
    ``client_state``, as ``deepspeed_ext.load_checkpoint`` does; FileNotFoundError when there is
    nothing to resume."""
    found = checkpoint.agreed_newest(load_dir, tag, verify_hashes=loader.config.checkpoint.verify == "hashes")
    if found is None:
        raise FileNotFoundError(f"no whole dyn-plugin checkpoint in {load_dir}")
    scheduler = scheduler or scheduler_of(model)
    state = _state(model, optimizer, scheduler, b"")
    dcp.load(state, checkpoint_id=found.path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    extra = pickle.loads(state[EXTRA])
    if not extra["stepped"]:
        optimizer.state.clear()
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    checkpoint.restore(loader, found)
    return found.path, extra["client_state"]
