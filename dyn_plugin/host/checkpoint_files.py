"""A checkpoint directory's files: hashed as they are synced, checked against that list, cleared
for a re-save, and locked against a second writer. The protocol (``checkpoint.py``) decides who
does what; everything here is one rank's work on one disk, and every I/O error raises, naming the
file (the protocol exchanges it between ranks).

The list (``Entry``: path, size, sha256) is what the marker commits to: a file truncated, damaged,
missing or added after the commit makes the checkpoint not whole. Hashing reads each file once,
from the page cache right after the host wrote it, in the same pass as its ``fsync``; sha256 runs
at about 2 GB/s a core (SHA-NI), and a rank hashes its share of the files on a few threads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable

from ..atomic import fsync_directory

logger = logging.getLogger(__name__)

MARKER = "dyn_plugin_checkpoint.json"
CHUNK = 8 << 20  # bytes read at a time: large enough that hashlib releases the GIL for most of it
THREADS = 4  # a rank's hashing threads (hashlib and file reads run outside the GIL)
LOCK_SUFFIX = ".dyn_plugin-lock"
PEER_PREFIX = ".dyn_plugin-peer-"
# what flock answers on a file system that has no locks (Lustre mounted without -o flock, some FUSE)
_NO_LOCKS = {errno.ENOLCK, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}


@dataclass(frozen=True)
class Entry:
    """One file of a checkpoint: its path inside the checkpoint's directory ('/'-separated), size, sha256."""

    path: str
    size: int
    sha256: str

    def to_json(self) -> list:
        return [self.path, self.size, self.sha256]

    @classmethod
    def from_json(cls, row: list) -> "Entry":
        path, size, digest = row
        if not isinstance(path, str) or not isinstance(size, int) or not isinstance(digest, str):
            raise ValueError(f"a file entry must be [path, size, sha256], got {row!r}")
        return cls(path, size, digest)


def is_ours(name: str) -> bool:
    """Files of the protocol itself, not of the checkpoint: the marker and its temporary names."""
    return name == MARKER or name.startswith(f".{MARKER}.")


def listing(directory: str) -> list[tuple[str, int]]:
    """Every file under ``directory`` written by the host, as (path inside it, size), sorted by path.
    Raises on any I/O error (an unreadable folder is not an empty one)."""

    def fail(exc: OSError) -> None:
        raise exc

    out = []
    for root, dirs, files in os.walk(directory, onerror=fail):
        dirs.sort()
        for name in files:
            if root == directory and is_ours(name):
                continue
            full = os.path.join(root, name)
            out.append((os.path.relpath(full, directory).replace(os.sep, "/"), os.stat(full).st_size))
    return sorted(out)


def share(files: list[tuple[str, int]], parts: int, index: int) -> list[tuple[str, int]]:
    """Part ``index`` of ``parts`` of ``files``, balanced by bytes (largest first, each to the least
    loaded part); every rank computes the same split from the same listing."""
    loads = [0] * parts
    mine = []
    for path, size in sorted(files, key=lambda f: (-f[1], f[0])):
        part = loads.index(min(loads))
        loads[part] += size
        if part == index:
            mine.append((path, size))
    return mine


def _hash_and_sync(directory: str, path: str, sync: bool) -> Entry:
    full = os.path.join(directory, *path.split("/"))
    h, size = hashlib.sha256(), 0
    fd = os.open(full, os.O_RDONLY)
    try:
        while block := os.read(fd, CHUNK):
            h.update(block)
            size += len(block)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return Entry(path, size, h.hexdigest())


def _each(fn, items: list) -> list:
    """``fn`` over ``items`` on a few threads, in order; the first error raises."""
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(THREADS, len(items))) as pool:
        return list(pool.map(fn, items))


def seal(directory: str, files: list[tuple[str, int]]) -> list[Entry]:
    """Hash and fsync each of ``files`` (this rank's share): the entries the marker will list.
    A file whose size changed since the listing is being written still: an error."""

    def one(f: tuple[str, int]) -> Entry:
        entry = _hash_and_sync(directory, f[0], sync=True)
        if entry.size != f[1]:
            raise OSError(
                errno.EBUSY,
                f"changed size while it was sealed ({f[1]} -> {entry.size} bytes): a writer is still at it",
                os.path.join(directory, f[0]),
            )
        return entry

    return _each(one, files)


def sync_tree(directory: str, root: str) -> None:
    """Every folder under ``directory``, then each one above it up to ``root``, fsynced (the new
    entries in them durable: files, the checkpoint's own folder in its parent). Errors raise."""
    for here, _, _ in os.walk(directory, topdown=False, onerror=_raise):
        fsync_directory(here, strict=True)
    here = os.path.dirname(os.path.abspath(directory))
    top = os.path.abspath(root)
    while here.startswith(top):
        fsync_directory(here, strict=True)
        if here == top:
            break
        here = os.path.dirname(here)


def _raise(exc: OSError) -> None:
    raise exc


def _gone_is_fine(_fn, _path, exc_info) -> None:
    """``rmtree``'s error hook: a file already gone (another writer of this disk cleared it) is fine."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def verify(directory: str, entries: Iterable[Entry], *, hashes: bool) -> list[str]:
    """What is wrong with ``entries`` in ``directory``, in words naming each file (empty: whole).
    Sizes always; contents too when ``hashes``."""

    def one(entry: Entry) -> str | None:
        full = os.path.join(directory, *entry.path.split("/"))
        try:
            size = os.stat(full).st_size
            if size != entry.size:
                return f"{full} has {size} bytes, its save wrote {entry.size} (truncated or overwritten)"
            if hashes:
                got = _hash_and_sync(directory, entry.path, sync=False)
                if got.sha256 != entry.sha256:
                    return f"{full} does not hash to what its save wrote (damaged after the save)"
        except FileNotFoundError:
            return f"{full} is missing"
        except OSError as exc:
            return f"{full} cannot be read: {exc.strerror or exc}"
        return None

    return [p for p in _each(one, list(entries)) if p is not None]


def strays(directory: str, entries: Iterable[Entry]) -> list[str]:
    """Files in ``directory`` its save did not write (copied in, or left by another writer)."""
    listed = {e.path for e in entries}
    return [
        f"{os.path.join(directory, path)} was not written by its save"
        for path, _ in listing(directory)
        if path not in listed
    ]


def nested_checkpoints(directory: str) -> list[str]:
    """Checkpoints inside ``directory`` (a marker below it): a checkpoint never holds another."""
    found = []
    for root, dirs, files in os.walk(directory, onerror=_raise):
        dirs.sort()
        if root != directory and MARKER in files:
            found.append(root)
            dirs.clear()
    return found


def clear(directory: str, *, keep_recent: bool = False) -> tuple[bool, list[str], list[str]]:
    """Empty ``directory`` for a re-save, marker first: the old checkpoint stops being whole before
    any of its files goes, and nothing of it (a shard of a larger world, say) survives into the new
    one. ``keep_recent``: the host may have written some of this save's files already (a loop's own
    files before Megatron's ``dist_checkpointing.save``, which is where the plugin sees the save), so
    only the files the old marker lists and that are older than it go; without a whole old marker
    nothing can be told apart and everything stays. Returns whether it held a marker, the names
    removed and the names kept."""
    marker = os.path.join(directory, MARKER)
    old = _old_files(directory) if keep_recent else None
    had_marker = False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(marker)
        had_marker = True
        fsync_directory(directory, strict=True)
    removed, kept = [], []
    if keep_recent:
        for path, _ in listing(directory):
            full = os.path.join(directory, *path.split("/"))
            if old is not None and path in old[0] and os.stat(full).st_mtime_ns < old[1]:
                os.unlink(full)
                removed.append(path)
            else:
                kept.append(path)
        for here, _, _ in os.walk(directory, topdown=False, onerror=_raise):
            fsync_directory(here, strict=True)
        return had_marker, removed, kept
    for entry in os.scandir(directory):
        if is_ours(entry.name):
            continue
        removed.append(entry.name)
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, onerror=_gone_is_fine)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    fsync_directory(directory, strict=True)
    return had_marker, sorted(removed), kept


def _old_files(directory: str) -> tuple[set[str], int] | None:
    """The paths a whole old marker lists and when it was written (ns), or None."""
    import json

    path = os.path.join(directory, MARKER)
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
        return {row[0] for row in doc["files"]}, os.stat(path).st_mtime_ns
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


class DirectoryLock:
    """An exclusive ``flock`` beside a checkpoint's directory (``.<name>.dyn_plugin-lock`` in its
    parent) for the length of one save: a second writer of the same directory (another run, a
    process started twice) is refused, naming the holder. The file is removed when the save ends;
    a killed save's stays behind, unlocked (the kernel releases a dead process's lock), and is
    taken over. Where the file system has no locks it warns once and saves unlocked."""

    warned = False

    def __init__(self, directory: str) -> None:
        parent, name = os.path.split(os.path.abspath(directory))
        self.path = os.path.join(parent, f".{name}{LOCK_SUFFIX}")
        self._fd: int | None = None
        for _ in range(8):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise RuntimeError(
                    f"{directory} is being saved by {holder}: two writers of one checkpoint would mix their files; "
                    "give each run its own save directory (or tag), or wait for the other save to end"
                ) from None
            except OSError as exc:
                os.close(fd)
                if exc.errno not in _NO_LOCKS:
                    raise
                self._unlocked(directory, exc)
                return
            try:  # the holder before may have removed the file between our open and our lock
                current = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                self._fd = fd
                break
            os.close(fd)
        else:
            raise RuntimeError(f"could not lock {self.path}: it is removed and made again by another process")
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()} since {stamp}\n".encode(), 0)

    @classmethod
    def _unlocked(cls, directory: str, exc: OSError) -> None:
        if not cls.warned:
            cls.warned = True
            logger.warning(
                "the file system of %s has no flock (%s): checkpoints are saved without the lock against a second "
                "writer",
                directory,
                exc.strerror,
            )

    def release(self) -> None:
        """Remove the file while still holding it (whoever opened it meanwhile finds it gone and retries)."""
        if self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None


def probe_name(token: str, rank: int) -> str:
    """The file by which the rank's disk is recognised by the others (``checkpoint``'s peers)."""
    return f"{PEER_PREFIX}{token}-{rank}"
