"""One checkpoint protocol for every host: a checkpoint is whole or absent, and the newest whole one wins.

A checkpoint is a directory. The host writes its own files there (DeepSpeed's engine, Megatron's
``dist_checkpointing``, ``torch.distributed.checkpoint`` under FSDP): ``begin`` first removes the
marker a re-used directory may hold, so a save killed half-way never passes for the old one. Then
``commit`` fsyncs every file in it and writes the marker, ``dyn_plugin_checkpoint.json``, last and
atomically (``dyn_plugin.atomic``). The marker holds the loader's position and what the plans depend
on (the dyn_plugin config's digest, the world size and layout), under a checksum.

On resume ``newest`` picks the newest directory whose marker is whole; one without (its save was
interrupted) is skipped with a warning, and naming it is refused: its data position is unknown.
``restore`` says before training what differs from the interrupted run (a changed config or world
size changes the plans from there on) and moves the loader to the saved position.

The marker is written by each node's local rank 0 (``LOCAL_RANK``) after every rank's files are
written, so nodes without a shared file system each keep a whole copy; ``agreed_newest`` picks the
newest checkpoint that is whole on every node.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from ..atomic import check_sha256, fsync_directory, with_sha256, write_json_atomic
from ..device import local_rank
from ..jsonfile import read_json
from ..runtime.loader import DynLoader

logger = logging.getLogger(__name__)

MARKER = "dyn_plugin_checkpoint.json"
VERSION = 1


@dataclass(frozen=True)
class Checkpoint:
    """A whole checkpoint: its directory, the loader position saved with it and the run that wrote it."""

    path: str
    position: int  # global batches trained before it (over every epoch): orders checkpoints
    loader: dict
    run: dict


@dataclass(frozen=True)
class Record:
    """What a marker will hold, taken when the save starts (an asynchronous save commits later,
    when the loader has moved on)."""

    position: int
    loader: dict
    run: dict

    @classmethod
    def of(cls, loader: DynLoader) -> "Record":
        return cls(loader.position, loader.state_dict(), run_identity(loader))


def run_identity(loader: DynLoader) -> dict:
    """What a plan depends on beyond the data: the config and the ranks it is planned for."""
    import torch.distributed as dist

    config = json.dumps(loader.config.model_dump(mode="json"), sort_keys=True)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return {
        "config_sha256": hashlib.sha256(config.encode()).hexdigest(),
        "world_size": world,
        "stages": loader.layout.stages,
        "columns": loader.layout.columns,
        "tp": loader.tp,
    }


def marker_path(directory: str | os.PathLike) -> str:
    return os.path.join(directory, MARKER)


def begin(directory: str | os.PathLike) -> None:
    """Before a host writes a checkpoint into ``directory`` (on each node's local rank 0): make it,
    and take a re-used directory's marker away first, so the directory reads as incomplete until
    ``commit``."""
    os.makedirs(directory, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(marker_path(directory))
        fsync_directory(os.fspath(directory))


def barrier() -> None:
    """Every rank here before any goes on (nothing to wait for without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def prepare(directory: str | os.PathLike) -> None:
    """Before a host writes a checkpoint into ``directory``: the writer ``begin``s it, and no rank
    writes into a directory that still carries its old marker. Every rank calls it."""
    if is_writer():
        begin(directory)
    barrier()


def publish(directory: str | os.PathLike, record: Record) -> None:
    """Once this rank's files are written: every rank's are, then each node's writer commits, and no
    rank goes on before every node's marker is written. Every rank calls it."""
    barrier()
    if is_writer():
        commit(directory, record)
    barrier()


def _fsync_tree(directory: str) -> None:
    """Every file the host wrote, on disk before the marker says they are: hosts save with
    ``torch.save``, which leaves them in the page cache."""
    for root, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):  # a file another rank is replacing: its writer syncs it
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_directory(root)


def commit(directory: str | os.PathLike, record: Record) -> str:
    """Publish the checkpoint in ``directory`` (each node's local rank 0, once every rank's files
    are written): its files fsynced, then the marker written atomically. Returns the marker's path."""
    directory = os.fspath(directory)
    _fsync_tree(directory)
    doc = {"version": VERSION, "position": record.position, "loader": record.loader, "run": record.run}
    return write_json_atomic(marker_path(directory), with_sha256(doc), indent=1)


def read(directory: str | os.PathLike) -> Checkpoint:
    """The checkpoint in ``directory``: FileNotFoundError when it has no marker (never published:
    its save was interrupted, or it was not written by dyn-plugin), ValueError naming the file when
    the marker is damaged or from another version."""
    path = marker_path(directory)
    doc = read_json(path, "checkpoint marker")
    if not isinstance(doc, dict):
        raise ValueError(f"checkpoint marker {path} holds {type(doc).__name__}, not an object")
    doc = check_sha256(doc, f"checkpoint marker {path}", required=True)
    if doc.get("version") != VERSION:
        raise ValueError(
            f"checkpoint marker {path} has version {doc.get('version')!r}; this dyn-plugin reads {VERSION}"
        )
    return Checkpoint(os.fspath(directory), int(doc["position"]), doc["loader"], doc["run"])


def complete(save_dir: str | os.PathLike) -> list[Checkpoint]:
    """The whole checkpoints directly under ``save_dir``, oldest first; every other directory is
    skipped with a warning naming it (an interrupted save, or a damaged marker)."""
    found: list[tuple[int, float, Checkpoint]] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in sorted(os.scandir(save_dir), key=lambda e: e.name):
            if not entry.is_dir() or entry.name.startswith("."):
                continue
            try:
                ckpt = read(entry.path)
            except FileNotFoundError:
                logger.warning("%s has no %s: its save was interrupted; skipped", entry.path, MARKER)
                continue
            except ValueError as exc:
                logger.warning("%s skipped: %s", entry.path, exc)
                continue
            found.append((ckpt.position, os.stat(marker_path(entry.path)).st_mtime, ckpt))
    return [c for _, _, c in sorted(found, key=lambda f: f[:2])]


def newest(save_dir: str | os.PathLike) -> Checkpoint | None:
    """The newest whole checkpoint under ``save_dir`` (None when there is none)."""
    found = complete(save_dir)
    return found[-1] if found else None


def agreed_newest(save_dir: str | os.PathLike, tag: str | None = None) -> Checkpoint | None:
    """``newest``, agreed by every rank: ``save_dir/tag`` when named (refused on every rank unless whole
    on every node), else the newest checkpoint whole on every node (nodes without a shared file
    system each hold their own copy). Every rank must call it."""
    import torch.distributed as dist

    if tag is not None:
        return read_everywhere(os.path.join(save_dir, tag), "resume from the newest whole one (no tag) or name another")
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return newest(save_dir)
    mine = {os.path.basename(c.path): c for c in complete(save_dir)}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(mine))
    common = set(mine).intersection(*map(set, everyone))
    if not common:
        return None
    # by position, then name: a file's time is a node's own, and every rank must pick the same one
    return mine[max(common, key=lambda n: (mine[n].position, n))]


def read_everywhere(directory: str | os.PathLike, missing: str) -> Checkpoint:
    """``read`` on every rank (each reads its node's copy), failing on all of them when it fails on
    one: a rank that raised alone would leave the others waiting in their next collective.
    ``missing``: what to do, said when the marker is absent. Every rank must call it."""
    import torch.distributed as dist

    ckpt, error = None, None
    try:
        ckpt = read(directory)
    except FileNotFoundError:
        error = (
            f"checkpoint {directory} is not whole: it has no {MARKER} (its save was interrupted, or it was not "
            f"written by dyn-plugin), so its data position is unknown; {missing}"
        )
    except ValueError as exc:
        error = str(exc)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise RuntimeError(error)
    assert ckpt is not None
    return ckpt


def differences(saved: dict, now: dict) -> list[str]:
    """What changed between the run that saved a checkpoint and this one, in words."""
    out = []
    if saved.get("config_sha256") != now["config_sha256"]:
        out.append("the dyn_plugin config changed")
    names = {
        "world_size": "ranks",
        "stages": "pipeline stages",
        "columns": "data-parallel columns",
        "tp": "tensor-parallel ranks",
    }
    for key, what in names.items():
        if saved.get(key) != now[key]:
            out.append(f"{what}: {saved.get(key)} -> {now[key]}")
    return out


def restore(loader: DynLoader, ckpt: Checkpoint) -> None:
    """Move ``loader`` to the checkpoint's position, saying first (once, on rank 0) what differs from
    the run that saved it: the plans from here on are made for this run, not the interrupted one."""
    import torch.distributed as dist

    changed = differences(ckpt.run, run_identity(loader))
    first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    if changed and first:
        logger.warning(
            "resuming from %s with %s: the steps from here are planned for this run, so they differ from "
            "what the interrupted run would have trained (the samples left are the same)",
            ckpt.path,
            "; ".join(changed),
        )
    loader.load_state_dict(ckpt.loader)


def is_writer() -> bool:
    """Whether this rank writes its node's markers (each node's local rank 0)."""
    return local_rank() == 0
