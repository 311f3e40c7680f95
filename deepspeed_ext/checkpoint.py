"""DeepSpeed's checkpoint under the plugin's protocol (``dyn_plugin.host.checkpoint``): whole or absent.

DeepSpeed writes ``save_dir/tag`` and then its ``latest`` file, and its loader trusts ``latest``: a kill
after ``latest`` and before the loader's position would resume with the wrong data. So DeepSpeed is
asked not to write ``latest``; the marker is written once every rank's files are, and ``latest`` after
it, naming only a whole checkpoint (for tools that read it, such as ``zero_to_fp32``). On load the
newest whole checkpoint wins; DeepSpeed is given its tag.
"""

from __future__ import annotations

import os

from dyn_plugin.atomic import write_atomic
from dyn_plugin.host import checkpoint
from dyn_plugin.runtime.loader import DynLoader

LATEST = "latest"  # DeepSpeed's own file: the tag its load_checkpoint(tag=None) reads


def save_checkpoint(
    engine, loader: DynLoader, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None
) -> str:
    """DeepSpeed's checkpoint of the engine (weights, optimizer, scheduler; ``client_state`` as
    DeepSpeed keeps it) plus the loader's position, published whole in ``save_dir/tag`` (default
    ``step<global_steps>``). Every rank calls it; returns the tag."""
    tag = tag or f"step{engine.global_steps}"
    directory = os.path.join(save_dir, tag)
    record = checkpoint.Record.of(loader)
    checkpoint.prepare(directory)
    engine.save_checkpoint(str(save_dir), tag=tag, client_state=client_state or {}, save_latest=False)
    checkpoint.publish(directory, record)
    if checkpoint.is_writer():  # after the marker: `latest` names only a whole checkpoint
        write_atomic(os.path.join(save_dir, LATEST), tag)
    return tag


def load_checkpoint(engine, loader: DynLoader, load_dir: str | os.PathLike, tag: str | None = None) -> tuple[str, dict]:
    """Restore the engine and the loader from the newest whole checkpoint under ``load_dir`` (or
    ``tag``, refused on every rank unless whole): training then continues with exactly the samples
    the interrupted epoch had left. Returns the checkpoint's path and ``client_state``, as DeepSpeed's
    ``load_checkpoint`` does; FileNotFoundError when there is nothing to resume."""
    found = checkpoint.agreed_newest(load_dir, tag)
    if found is None:
        raise FileNotFoundError(f"no whole dyn-plugin checkpoint in {load_dir}")
    tag = os.path.basename(found.path)
    path, client_state = engine.load_checkpoint(str(load_dir), tag=tag)
    if path is None:
        raise FileNotFoundError(f"DeepSpeed found no checkpoint in {found.path}")
    checkpoint.restore(loader, found)
    return path, client_state or {}
