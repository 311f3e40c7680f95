"""One checkpoint protocol for every host: a checkpoint is whole or absent, the latest whole one is
resumed, and a failure on any rank fails the save (or the load) alike on every rank.

A checkpoint is a directory ``root/tag`` (a tag may be nested: ``run1/step10``). Saving, on every rank:

1. ``prepare``: the ranks learn which of them see the same disk under ``root`` (``peers``: a shared
   file system, or one node's local disk), and one of each disk (its *leader*) locks the directory
   against a second writer (``checkpoint_files.DirectoryLock``) and clears it: the old marker first,
   then every file, so nothing of an earlier save (a shard of a larger world, say) survives into this one.
2. The host writes its files (DeepSpeed's engine, Megatron's ``dist_checkpointing``,
   ``torch.distributed.checkpoint`` under FSDP).
3. ``publish``: each rank hashes and fsyncs its share of the files, the leader checks every file is
   listed once, fsyncs the directories up to ``root`` and writes the marker, ``dyn_plugin_checkpoint.json``,
   last and atomically. The marker holds the loader's position, what the plans depend on, a
   ``sequence`` one above every checkpoint under ``root`` (and the checkpoint this run descends
   from), and every file's path, size and sha256, under a checksum.

Every step ends in an exchange (``exchange``): an I/O error on any rank (a failed write, fsync or
rename: EIO, ENOSPC, EDQUOT) fails the save on every rank with the file and the error named, and
no marker is written.

Resuming (``agreed_newest``): each disk's leader lists the whole markers under ``root``; the ranks
agree on a checkpoint by (sequence, marker digest), not by name, so a stale copy under the same
name on one node is never mixed with the others; the latest one (the highest sequence: the most
recent save, also after a resume from an older tag on purpose) whose files all have their listed
size, and hash (``checkpoint.verify: hashes``, the default), on every disk wins; a damaged one is
skipped with a warning naming the file, and refused when named. ``restore`` says before training
what differs from the interrupted run and moves the loader to the saved position.
"""

from __future__ import annotations

import logging
import os
import posixpath
import secrets
import socket
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from ..atomic import check_sha256, fsync_directory, with_sha256, write_atomic, write_json_atomic
from ..jsonfile import read_json
from ..runtime.loader import DynLoader
from ..runtime.plan_agreement import plan_config_digest
from ..version import __version__
from .checkpoint_files import (
    MARKER,
    DirectoryLock,
    Entry,
    clear,
    listing,
    nested_checkpoints,
    probe_name,
    seal,
    share,
    strays,
    sync_tree,
    verify,
)
from .exchange import attempt, describe, gather, group, raise_any

logger = logging.getLogger(__name__)

VERSION = 2
READS = (1, 2)  # version 1: no sequence and no file list (dyn-plugin before checkpoints listed their files)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, found or read: raised alike on every rank."""


@dataclass(frozen=True)
class Checkpoint:
    """A whole checkpoint: its directory, the loader position saved with it and the run that wrote it."""

    path: str
    position: int  # global batches trained before it (over every epoch)
    loader: dict
    run: dict
    sequence: int = 0  # one above every earlier save under its root: orders checkpoints (0: version 1)
    digest: str = ""  # the marker's checksum: what ranks agree on
    files: tuple[Entry, ...] | None = None  # None: a version-1 marker, which lists none
    parent: dict | None = None  # the checkpoint the saving run had resumed from or saved before

    @property
    def lineage(self) -> dict:
        return {"path": self.path, "sequence": self.sequence, "digest": self.digest}


@dataclass(frozen=True)
class Record:
    """What a marker will hold, taken when the save starts (an asynchronous save commits later,
    when the loader has moved on)."""

    position: int
    loader: dict
    run: dict
    parent: dict | None = None
    owner: Any = field(default=None, compare=False, repr=False)  # a weak reference to the loader it describes

    @classmethod
    def of(cls, loader: DynLoader) -> "Record":
        return cls(
            loader.position, loader.state_dict(), run_identity(loader), _LINEAGE.get(loader), weakref.ref(loader)
        )


# the checkpoint each loader last resumed from or saved: the next save's parent (kept off the loader)
_LINEAGE: "weakref.WeakKeyDictionary[DynLoader, dict]" = weakref.WeakKeyDictionary()
# the saves between prepare and publish in this process, by directory: a host's own save call inside
# one (Megatron's dist_checkpointing.save inside a loop's checkpoint.saving) joins it
_OPEN: "dict[str, Save]" = {}


def run_identity(loader: DynLoader) -> dict:
    """What a plan depends on beyond the data: the config (not where plans travel: the store and
    loader sections, which may hold a password, stay out), the ranks it is planned for, the plugin."""
    _, world = group()
    return {
        "config_sha256": plan_config_digest(loader.config),
        "world_size": world,
        "stages": loader.layout.stages,
        "columns": loader.layout.columns,
        "tp": loader.layout.tp,
        "dyn_plugin": __version__,
    }


def marker_path(directory: str | os.PathLike) -> str:
    return os.path.join(directory, MARKER)


def check_tag(tag: str) -> str:
    """A tag names a directory under the save directory: relative, '/'-separated, no '.', '..' or
    hidden parts (hidden names are the protocol's own)."""
    if not isinstance(tag, str) or not tag or tag.startswith("/") or "\\" in tag:
        raise ValueError(f"checkpoint tag {tag!r}: give a relative path such as 'step10' or 'run1/step10'")
    parts = tag.split("/")
    bad = [p for p in parts if p in ("", ".", "..") or p.startswith(".")]
    if bad:
        raise ValueError(
            f"checkpoint tag {tag!r} has the part {bad[0]!r}: tags are relative paths under the save directory "
            "without empty, '.', '..' or hidden ('.'-prefixed) parts, e.g. 'step10' or 'run1/step10'"
        )
    return posixpath.normpath(tag)


# --- which ranks see the same disk -------------------------------------------------------------


def peers(root: str, *, required: bool) -> list[list[int]]:
    """The ranks grouped by the disk on which they see ``root``: one group on a shared file system,
    one per node on node-local disks. Ranks on one machine naming the same path share it; machines
    are compared by a file with a fresh name (``probe_name``) that one rank of each creates and the
    others look up by that name (no directory listing, which a network file system may cache).
    ``required``: the probe must be written (a save); a load falls back to one group per machine.
    Every rank must call it."""
    rank, world = group()
    if world == 1:
        return [[0]]
    rows = gather(((socket.gethostname(), os.path.realpath(root)), secrets.token_hex(8)))
    keys, token = [r[0] for r in rows], rows[0][1]
    first = {k: min(r for r in range(world) if keys[r] == k) for k in set(keys)}
    by_first = {f: [r for r in range(world) if first[keys[r]] == f] for f in first.values()}
    if len(by_first) == 1:
        return [list(range(world))]
    mine = first[keys[rank]] == rank
    probe = os.path.join(root, probe_name(token, rank))

    def create() -> None:
        if required:
            os.makedirs(root, exist_ok=True)
        with open(probe, "x"):
            pass

    _, error = attempt(create, f"writing {probe}") if mine else (None, None)
    errors = gather(error)
    if any(errors):
        if mine and error is None:
            _remove(probe)
        if required:
            raise_any(errors, lambda m: CheckpointError(f"cannot save under {root}: {m}"))
        return sorted(by_first.values())
    seen = sorted(f for f in by_first if os.path.exists(os.path.join(root, probe_name(token, f)))) if mine else None
    rows = gather(seen)
    if mine:
        _remove(probe)
    # machines see one disk when each sees the other's probe
    groups: list[list[int]] = []
    for f in sorted(by_first):
        joined = next((g for g in groups if f in rows[g[0]] and g[0] in rows[f]), None)
        if joined is None:
            groups.append([f])
        else:
            joined.append(f)
    return sorted(sorted(r for f in g for r in by_first[f]) for g in groups)


def _names(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError as exc:
        logger.warning("could not remove %s: %s", path, exc.strerror)


def _my_group(groups: list[list[int]]) -> list[int]:
    rank, _ = group()
    return next(g for g in groups if rank in g)


# --- saving ------------------------------------------------------------------------------------


@dataclass
class Save:
    """One save under way (``prepare`` to ``publish``), alike on every rank but for ``lock``."""

    root: str
    tag: str
    record: Record
    sequence: int
    peers: list[int]  # the ranks that see this rank's disk (this one included)
    lock: DirectoryLock | None = None  # held by the disk's leader

    @property
    def directory(self) -> str:
        return os.path.join(self.root, *self.tag.split("/"))

    @property
    def leader(self) -> bool:
        return group()[0] == self.peers[0]

    def failed(self, why: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {self.directory} was not saved: {why}; nothing of it was published (no marker), the "
            "previous whole checkpoint stays the one to resume"
        )


def prepare(
    root: str | os.PathLike,
    tag: str,
    record: Record,
    *,
    before: Callable[[], None] | None = None,
    keep_recent: bool = False,
) -> Save:
    """Before a host writes the checkpoint ``root/tag``: the ranks sharing a disk found, the
    directory locked, made and cleared by each disk's leader, which then runs ``before`` (a host's
    own step, such as moving DeepSpeed's ``latest`` off this tag). ``keep_recent``: files written
    since the old checkpoint there stay (``checkpoint_files.clear``), for a host that is seen only
    once some of the save is written. Every rank calls it."""
    root = os.fspath(root)
    tag = check_tag(tag)
    mine = _my_group(peers(root, required=True))
    save = Save(root, tag, record, 0, mine)
    directory = save.directory
    if os.path.abspath(directory) in _OPEN:
        raise CheckpointError(f"checkpoint {directory} is being saved already in this process")

    def lead() -> int:
        os.makedirs(os.path.dirname(directory), exist_ok=True)
        save.lock = DirectoryLock(directory)  # beside it, in its parent
        os.makedirs(directory, exist_ok=True)
        nested = nested_checkpoints(directory)
        if nested:
            raise ValueError(
                f"it holds the checkpoint {nested[0]}: a checkpoint's directory cannot hold another; choose another tag"
            )
        had_marker, removed, kept = clear(directory, keep_recent=keep_recent)
        if removed and not had_marker:
            logger.warning("saving %s removed what an interrupted save left there: %s", directory, _names(removed))
        if kept and not had_marker:
            logger.warning(
                "saving %s keeps what its folder held before it (no whole old checkpoint tells what an earlier save "
                "wrote): %s; write a loop's own files inside checkpoint.saving(...) to have them cleared safely",
                directory,
                _names(kept),
            )
        sync_tree(directory, root)  # its entry in the parent (a new tag) durable before files land in it
        if before is not None:
            before()
        return max((c.sequence for c in complete(root, warn=False)), default=0)

    latest, error = attempt(lead, f"preparing {directory}") if save.leader else (0, None)
    rows = gather((latest, error))
    try:
        raise_any([e for _, e in rows], save.failed)
    except CheckpointError:
        release(save)
        raise
    parent = record.parent["sequence"] if record.parent else 0
    save.sequence = max([parent, *(s or 0 for s, _ in rows)]) + 1
    _OPEN[os.path.abspath(directory)] = save
    return save


def open_save(directory: str | os.PathLike) -> Save | None:
    """The save under way into ``directory`` in this process (between ``prepare`` and ``publish``), if any."""
    return _OPEN.get(os.path.abspath(os.fspath(directory)))


def release(save: Save) -> None:
    """The save is over (published or failed): its lock released."""
    _OPEN.pop(os.path.abspath(save.directory), None)
    if save.lock is not None:
        save.lock.release()
        save.lock = None


def commit(directory: str, doc: dict) -> str:
    """Write the marker (the leader of each disk, every file already synced): atomically, and the
    directory synced after the rename. Returns the marker's path."""
    return write_json_atomic(marker_path(directory), doc, indent=1, strict=True)


def publish(save: Save, failure: BaseException | None = None, *, after: Callable[[], None] | None = None) -> Checkpoint:
    """Once this rank's files are written (``failure``: what went wrong writing them here): every
    rank's share of the files hashed and synced, then each disk's leader writes the marker and runs
    ``after`` (a host's own step, such as DeepSpeed's ``latest``). Raises ``CheckpointError`` on
    every rank when any rank failed anywhere. Every rank calls it."""
    rank, _ = group()
    directory = save.directory
    try:
        errors = gather(None if failure is None else f"rank {rank}: writing the files: {describe(failure)}")
        raise_any(errors, save.failed)

        def seal_mine() -> tuple[list, list]:
            files = listing(directory)
            return files, [e.to_json() for e in seal(directory, share(files, len(save.peers), save.peers.index(rank)))]

        sealed, error = attempt(seal_mine, "hashing and syncing the files")
        rows = gather((None if sealed is None else sealed[1], error))
        raise_any([e for _, e in rows], save.failed)

        def lead() -> str:
            assert sealed is not None
            entries = sorted((Entry.from_json(e) for r in save.peers for e in rows[r][0]), key=lambda e: e.path)
            if [e.path for e in entries] != [path for path, _ in sealed[0]]:
                raise RuntimeError(
                    f"the ranks that share this disk ({save.peers}) listed different files in {directory}: "
                    "a file system that shows them different contents cannot hold a checkpoint"
                )
            sync_tree(directory, save.root)
            record = save.record
            doc = with_sha256(
                {
                    "version": VERSION,
                    "sequence": save.sequence,
                    "parent": record.parent,
                    "position": record.position,
                    "loader": record.loader,
                    "run": record.run,
                    "files": [e.to_json() for e in entries],
                }
            )
            commit(directory, doc)
            if after is not None:
                after()
            return doc["sha256"]

        digest, error = attempt(lead, "writing the marker") if save.leader else (None, None)
        rows = gather((digest, error))
        raise_any([e for _, e in rows], save.failed)
    finally:
        release(save)
    record = save.record
    found = Checkpoint(
        directory,
        record.position,
        record.loader,
        record.run,
        save.sequence,
        rows[save.peers[0]][0],
        None,
        record.parent,
    )
    loader = record.owner() if record.owner is not None else None
    if loader is not None:
        _LINEAGE[loader] = found.lineage
    return found


def saving(root: str | os.PathLike, tag: str, record: Record, **hooks: Callable[[], None]) -> "_Saving":
    """``with checkpoint.saving(root, tag, record) as save:`` the host writes ``save.directory``;
    ``prepare`` before the block and ``publish`` after it, with the block's error, if any, exchanged
    like any other. ``hooks``: ``before`` and ``after``, as ``prepare`` and ``publish`` take them."""
    return _Saving(os.fspath(root), tag, record, hooks)


class _Saving:
    def __init__(self, root: str, tag: str, record: Record, hooks: dict) -> None:
        self.args, self.hooks = (root, tag, record), hooks
        self.save: Save | None = None
        self.published: Checkpoint | None = None

    def __enter__(self) -> Save:
        self.save = prepare(*self.args, before=self.hooks.get("before"))
        return self.save

    def __exit__(self, kind, exc, tb) -> bool:
        assert self.save is not None
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            release(self.save)  # the process is going away
            return False
        # any other failure, torch's CheckpointException (a BaseException) included, is exchanged
        self.published = publish(self.save, exc, after=self.hooks.get("after"))
        return False


# --- reading -----------------------------------------------------------------------------------


def read(directory: str | os.PathLike) -> Checkpoint:
    """The checkpoint in ``directory`` as its marker describes it: FileNotFoundError when it has no
    marker (never published: its save was interrupted, or it was not written by dyn-plugin),
    ValueError naming the file when the marker is damaged or from another version. Its files are not
    checked here (``verify``)."""
    path = marker_path(directory)
    doc = read_json(path, "checkpoint marker")
    if not isinstance(doc, dict):
        raise ValueError(f"checkpoint marker {path} holds {type(doc).__name__}, not an object")
    digest = doc.get("sha256", "")
    doc = check_sha256(doc, f"checkpoint marker {path}", required=True)
    version = doc.get("version")
    if version not in READS:
        raise ValueError(f"checkpoint marker {path} has version {version!r}; this dyn-plugin reads {list(READS)}")
    try:
        files = None if version == 1 else tuple(Entry.from_json(row) for row in doc["files"])
        return Checkpoint(
            os.fspath(directory),
            int(doc["position"]),
            doc["loader"],
            doc["run"],
            int(doc.get("sequence", 0)),
            str(digest),
            files,
            doc.get("parent"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint marker {path} is malformed ({describe(exc)})") from None


def complete(root: str | os.PathLike, *, warn: bool = True) -> list[Checkpoint]:
    """The checkpoints under ``root`` (nested tags included) whose marker is whole, oldest first
    (by sequence, then position); every other directory holding files, or nothing, is skipped with a
    warning naming it (an interrupted save, a damaged or unreadable marker; ``warn=False``: silently,
    as a save looking for the highest sequence does). Their files are not checked here."""
    root = os.fspath(root)
    found = []
    say = logger.warning if warn else logger.debug
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if here == root:
            continue
        if MARKER not in files:
            if not dirs or any(not f.startswith(".") for f in files):  # not a folder of tags (run1/ of run1/step10)
                say("%s has no %s: its save was interrupted; skipped", here, MARKER)
            continue
        dirs.clear()  # a checkpoint holds no other
        try:
            found.append(read(here))
        except FileNotFoundError:
            say("%s lost its %s while being read; skipped", here, MARKER)
        except (OSError, ValueError) as exc:
            say("%s skipped: %s", here, describe(exc) if isinstance(exc, OSError) else exc)
    return sorted(found, key=lambda c: (c.sequence, c.position, c.path))


def move_pointer_off(pointer: str, root: str, rewritten: str, name: Callable[[str], str | None]) -> None:
    """Before checkpoint directory ``rewritten`` is saved again: a host's pointer file (DeepSpeed's
    ``latest``, Megatron-LM's tracker) that names it names the newest other whole checkpoint under
    ``root`` instead, or is removed, so a failed re-save leaves it naming no directory that is not
    whole. ``name(path)``: what the pointer holds for the checkpoint at ``path`` (None: one it
    cannot name). A loop without a pointer file is left as it is."""
    try:
        with open(pointer) as f:
            named = f.read().strip()
    except FileNotFoundError:
        return
    if named != name(rewritten):
        return
    others = [
        held
        for c in complete(root, warn=False)
        if os.path.abspath(c.path) != os.path.abspath(rewritten) and (held := name(c.path)) is not None
    ]
    if others:
        write_atomic(pointer, others[-1], strict=True)
    else:
        os.unlink(pointer)
        fsync_directory(root, strict=True)


def _check_everywhere(directory: str, mine: list[int], hashes: bool) -> tuple[Checkpoint | None, list[str]]:
    """Every rank reads ``directory``'s marker on its disk and checks its share of the files (sizes,
    and contents when ``hashes``); each disk's leader also looks for files its save did not write.
    Returns the checkpoint and, alike on every rank, what is wrong with it anywhere."""
    rank, _ = group()

    def check() -> tuple[Checkpoint | None, list[str]]:
        try:
            ckpt = read(directory)
        except FileNotFoundError:
            return None, [_no_marker(directory)]
        if ckpt.files is None:
            return ckpt, []
        files = [(e.path, e.size) for e in ckpt.files]
        wanted = {path for path, _ in share(files, len(mine), mine.index(rank))}
        problems = verify(directory, [e for e in ckpt.files if e.path in wanted], hashes=hashes)
        if rank == mine[0]:
            problems += strays(directory, ckpt.files)
        return ckpt, problems

    got, error = attempt(check, f"reading {marker_path(directory)}")
    ckpt = got[0] if got is not None else None
    rows = gather((None if ckpt is None else ckpt.digest, got[1] if got is not None else [error]))
    problems = [p for _, found in rows for p in found if p is not None]
    digests = {d for d, _ in rows if d is not None}
    if len(digests) > 1:
        seen = ", ".join(f"rank {r}: {d[:12]}" for r, (d, _) in enumerate(rows) if d is not None)
        problems.append(
            f"the ranks read different markers in {directory} ({seen}): a node holds another checkpoint under the "
            "same name (a stale copy)"
        )
    return ckpt, problems


def _no_marker(directory: str) -> str:
    return f"{directory} has no {MARKER}"


def agreed_newest(root: str | os.PathLike, tag: str | None = None, *, verify_hashes: bool = True) -> Checkpoint | None:
    """The checkpoint to resume, agreed by every rank: ``root/tag`` when named (refused on every
    rank unless whole on every disk), else the latest (highest sequence) whole on every disk; None
    when there is none. ``verify_hashes``: check each file's contents, not only its size
    (``checkpoint.verify`` in the config). Every rank must call it."""
    root = os.fspath(root)
    if tag is not None:
        return read_everywhere(
            os.path.join(root, *check_tag(tag).split("/")),
            "resume from the newest whole one (no tag) or name another",
            verify_hashes=verify_hashes,
            root=root,
        )
    rank, world = group()
    groups = peers(root, required=False)
    mine = _my_group(groups)

    def scan() -> dict:
        return {os.path.relpath(c.path, root): (c.sequence, c.position, c.digest) for c in complete(root)}

    found, error = attempt(scan, f"listing the checkpoints under {root}") if rank == mine[0] else ({}, None)
    rows = gather((found, error))
    raise_any([e for _, e in rows], lambda m: CheckpointError(f"cannot find a checkpoint to resume: {m}"))
    leaders = [rows[g[0]][0] for g in groups]
    common = [tag for tag, seen in leaders[0].items() if all(other.get(tag) == seen for other in leaders[1:])]
    if rank == 0:
        partial = sorted({t for seen in leaders for t in seen} - set(common))
        for tag in partial:
            logger.warning("%s is not the same whole checkpoint on every node; skipped", os.path.join(root, tag))
    for tag in sorted(common, key=lambda t: (*leaders[0][t][:2], t), reverse=True):
        directory = os.path.join(root, tag)
        ckpt, problems = _check_everywhere(directory, mine, verify_hashes)
        if not problems and ckpt is not None:
            return ckpt
        if rank == 0:
            logger.warning("%s is not whole, skipped: %s", directory, "; ".join(problems))
    return None


def read_everywhere(
    directory: str | os.PathLike, missing: str, *, verify_hashes: bool = True, root: str | None = None
) -> Checkpoint:
    """The checkpoint in ``directory``, read and checked on every rank (each on its disk), refused on
    all of them when it is not whole on one. ``missing``: what to do, said when the marker is absent.
    ``root``: where the ranks compare disks (default: the directory's parent). Every rank must call it."""
    directory = os.fspath(directory)
    mine = _my_group(peers(root or os.path.dirname(os.path.abspath(directory)), required=False))
    ckpt, problems = _check_everywhere(directory, mine, verify_hashes)
    if problems:
        if _no_marker(directory) in problems:
            raise CheckpointError(
                f"checkpoint {directory} is not whole: it has no {MARKER} (its save was interrupted, or it was not "
                f"written by dyn-plugin), so its data position is unknown; {missing}"
            )
        raise CheckpointError(f"checkpoint {directory} is not whole: {'; '.join(problems)}; {missing}")
    assert ckpt is not None
    if ckpt.files is None and group()[0] == 0:
        logger.warning("%s was saved by a dyn-plugin that listed no files: its files are not checked", directory)
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
        "dyn_plugin": "dyn-plugin version",
    }
    for key, what in names.items():
        if key in saved and saved.get(key) != now[key]:
            out.append(f"{what}: {saved.get(key)} -> {now[key]}")
    return out


def restore(loader: DynLoader, ckpt: Checkpoint) -> None:
    """Move ``loader`` to the checkpoint's position, saying first (once, on rank 0) what differs from
    the run that saved it: the plans from here on are made for this run, not the interrupted one.
    The loader's next save descends from this checkpoint."""
    changed = differences(ckpt.run, run_identity(loader))
    if changed and group()[0] == 0:
        logger.warning(
            "resuming from %s with %s: the steps from here are planned for this run, so they differ from "
            "what the interrupted run would have trained (the samples left are the same)",
            ckpt.path,
            "; ".join(changed),
        )
    loader.load_state_dict(ckpt.loader)
    _LINEAGE[loader] = ckpt.lineage


__all__ = [
    "MARKER",
    "Checkpoint",
    "CheckpointError",
    "Record",
    "Save",
    "agreed_newest",
    "check_tag",
    "commit",
    "complete",
    "prepare",
    "publish",
    "read",
    "read_everywhere",
    "restore",
    "saving",
]
