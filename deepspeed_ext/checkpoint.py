"""DeepSpeed's checkpoint under the plugin's protocol (``dyn_plugin.host.checkpoint``): whole or absent.

DeepSpeed writes ``save_dir/tag`` and then its ``latest`` file, and its own loader (and
``zero_to_fp32``) trusts ``latest``. So DeepSpeed is asked not to write ``latest``: before a save,
a ``latest`` naming the tag about to be rewritten is moved to the newest other whole checkpoint (or
removed), and once the marker is written ``latest`` names the new one, so it never names a
checkpoint that is not whole. A write that fails inside DeepSpeed's save is kept, not raised, until
DeepSpeed's closing barrier has passed, then exchanged: every rank raises it. Tags may be nested
(``run1/step10``); the load hands DeepSpeed the tag relative to the save directory.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

from dyn_plugin.atomic import write_atomic
from dyn_plugin.host import checkpoint
from dyn_plugin.runtime.loader import DynLoader

LATEST = "latest"  # DeepSpeed's own file: the tag its load_checkpoint(tag=None) reads


class _KeptErrors:
    """DeepSpeed's checkpoint engine with each write's error kept instead of raised: DeepSpeed's save
    ends in a barrier that a rank which raised would never reach, leaving the others inside it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.errors: list[Exception] = []

    def save(self, state_dict: Any, path: str) -> None:
        if self.errors:
            return  # this save has failed already; the rest is not worth writing
        try:
            self._inner.save(state_dict, path)
        except Exception as exc:
            self.errors.append(exc if isinstance(exc, OSError) and exc.filename else OSError(f"writing {path}: {exc}"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def _writes_kept(engine) -> Iterator[_KeptErrors]:
    """For the length of one save, the engine's writes go through ``_KeptErrors`` (DeepSpeed's pipeline
    module writes its layers through the same engine attribute), restored after."""
    kept = _KeptErrors(engine.checkpoint_engine)
    engine.checkpoint_engine = kept
    try:
        yield kept
    finally:
        engine.checkpoint_engine = kept._inner


def _tag_of(path: str, save_dir: str | os.PathLike) -> str:
    return os.path.relpath(path, save_dir).replace(os.sep, "/")


def save_checkpoint(
    engine, loader: DynLoader, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None
) -> str:
    """DeepSpeed's checkpoint of the engine (weights, optimizer, scheduler; ``client_state`` as
    DeepSpeed keeps it) plus the loader's position, published whole in ``save_dir/tag`` (default
    ``step<global_steps>``). Every rank calls it; returns the tag. Any rank's failure raises
    ``CheckpointError`` on every rank, and nothing is published."""
    save_dir = os.fspath(save_dir)
    tag = checkpoint.check_tag(tag or f"step{engine.global_steps}")
    with checkpoint.saving(
        save_dir,
        tag,
        checkpoint.Record.of(loader),
        before=lambda: checkpoint.move_pointer_off(
            os.path.join(save_dir, LATEST),
            save_dir,
            os.path.join(save_dir, *tag.split("/")),
            lambda path: _tag_of(path, save_dir),
        ),
        after=lambda: write_atomic(os.path.join(save_dir, LATEST), tag, strict=True),
    ):
        with _writes_kept(engine) as kept:
            engine.save_checkpoint(save_dir, tag=tag, client_state=client_state or {}, save_latest=False)
        if kept.errors:
            raise kept.errors[0]
    return tag


def load_checkpoint(engine, loader: DynLoader, load_dir: str | os.PathLike, tag: str | None = None) -> tuple[str, dict]:
    """Restore the engine and the loader from the latest whole checkpoint under ``load_dir`` (or
    ``tag``, refused on every rank unless whole): training then continues with exactly the samples
    the interrupted epoch had left. Returns the checkpoint's path and ``client_state``, as DeepSpeed's
    ``load_checkpoint`` does; FileNotFoundError when there is nothing to resume."""
    found = checkpoint.agreed_newest(load_dir, tag, verify_hashes=loader.config.checkpoint.verify == "hashes")
    if found is None:
        raise FileNotFoundError(f"no whole dyn-plugin checkpoint in {load_dir}")
    path, client_state = engine.load_checkpoint(str(load_dir), tag=_tag_of(found.path, load_dir))
    if path is None:
        raise FileNotFoundError(f"DeepSpeed found no checkpoint in {found.path}")
    checkpoint.restore(loader, found)
    return path, client_state or {}
