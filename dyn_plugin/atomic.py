"""Files written whole or not at all, and JSON that can tell when it was damaged; standard library only.

Every file the plugin writes (plans, profiles, proposal caches, checkpoints' loader position,
reports, plots, bench records) goes to a unique temporary name in the target's directory, is
flushed and fsynced, and is renamed onto the target (``os.replace``, atomic within a directory);
the directory is fsynced after. A reader, or a run killed mid-write, sees the old file or the new
one, never half of one, and two writers of the same target never share a temporary file. The
temporary file is removed when the write fails.

``payload_sha256`` is the checksum of a JSON document's payload (everything but its ``sha256``
key, serialized canonically), which files the plugin reads back (profiles, sharding plans,
strategy proposals and their cache) carry, so damage that still parses is caught by
``check_sha256``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import tempfile
from typing import Any, Iterator

CHECKSUM_KEY = "sha256"
_UMASK: int | None = None


def _umask() -> int:
    """The process's umask, read once (``os.umask`` can only be read by setting it)."""
    global _UMASK
    if _UMASK is None:
        try:
            with open("/proc/self/status") as f:
                _UMASK = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
        except (OSError, StopIteration, ValueError, IndexError):
            _UMASK = os.umask(0o022)
            os.umask(_UMASK)
    return _UMASK


def _mode(target: str) -> int:
    """The mode the written file gets: the replaced file's, else what ``open(path, "w")`` would give."""
    try:
        return os.stat(target).st_mode & 0o7777
    except OSError:
        return 0o666 & ~_umask()


# what a file system that cannot open or fsync a directory answers: nothing to make durable there
_NO_DIRECTORY_SYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EISDIR}


def fsync_directory(directory: str, *, strict: bool = False) -> None:
    """Make the entries of ``directory`` (a rename, a new file or folder) durable. Some file systems
    cannot open or fsync a directory: that is never an error. Any other failure (EIO, ENOSPC, EDQUOT)
    is ignored unless ``strict``, where it raises: a checkpoint must not be published over it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        if strict and exc.errno not in _NO_DIRECTORY_SYNC:
            raise


def _target(path: str | os.PathLike) -> tuple[str, str]:
    """(the file to replace, its directory): a symbolic link's target is replaced, the link kept."""
    target = os.path.realpath(os.fspath(path))
    return target, os.path.dirname(target)


def _temporary(target: str, directory: str) -> tuple[int, str]:
    """A new, unique file beside ``target``, hidden, ending in the target's suffix (matplotlib and
    numpy choose the format by it)."""
    base = os.path.basename(target)
    return tempfile.mkstemp(dir=directory, prefix=f".{base}.", suffix=f".tmp{os.path.splitext(base)[1]}")


def _publish(tmp: str, target: str, directory: str, strict: bool = False) -> None:
    os.chmod(tmp, _mode(target))
    os.replace(tmp, target)
    fsync_directory(directory, strict=strict)


def write_atomic(path: str | os.PathLike, data: bytes | str, *, strict: bool = False) -> str:
    """Write ``data`` (str as UTF-8) to ``path`` whole or not at all (see the module docstring);
    returns the path written. ``strict``: a failure to sync the directory after the rename raises
    too (``fsync_directory``), for files whose durability others rely on (a checkpoint's marker)."""
    target, directory = _target(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    fd, tmp = _temporary(target, directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, target, directory, strict)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def write_json_atomic(path: str | os.PathLike, obj: Any, *, strict: bool = False, **dumps: Any) -> str:
    """``obj`` as JSON (``dumps``: ``json.dumps``'s options), newline-terminated, written atomically."""
    return write_atomic(path, json.dumps(obj, **dumps) + "\n", strict=strict)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """For writers that take a file name (``fig.savefig``, ``np.save``, a tokenizer's ``save``): yields a
    temporary name beside ``path`` with its suffix; when the block ends the file written there is
    fsynced and renamed onto ``path``, and when the block raises it is removed and ``path`` is untouched."""
    target, directory = _target(path)
    fd, tmp = _temporary(target, directory)
    os.close(fd)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        _publish(tmp, target, directory)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def payload_sha256(doc: dict) -> str:
    """The sha256 (hex) of ``doc`` without its ``sha256`` key, as canonical JSON (sorted keys, no spaces):
    the same for a document and what ``json.loads`` reads back of any serialization of it."""
    payload = {k: v for k, v in doc.items() if k != CHECKSUM_KEY}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def with_sha256(doc: dict) -> dict:
    """``doc`` with its payload's checksum added under ``sha256``."""
    return {**{k: v for k, v in doc.items() if k != CHECKSUM_KEY}, CHECKSUM_KEY: payload_sha256(doc)}


def check_sha256(doc: dict, where: str, *, required: bool = False) -> dict:
    """``doc`` without its checksum, after checking it: ValueError naming ``where`` when the checksum
    does not match the payload (the file was damaged or edited), or is missing and ``required``."""
    if CHECKSUM_KEY not in doc:
        if required:
            raise ValueError(f"{where} has no {CHECKSUM_KEY} checksum; it was not written whole by dyn-plugin")
        return doc
    want = doc[CHECKSUM_KEY]
    got = payload_sha256(doc)
    if want != got:
        raise ValueError(
            f"{where} is corrupt: its {CHECKSUM_KEY} checksum {str(want)[:16]}... does not match its contents "
            f"({got[:16]}...); write it again (or, if you edited it on purpose, delete its {CHECKSUM_KEY!r} key)"
        )
    return {k: v for k, v in doc.items() if k != CHECKSUM_KEY}


__all__ = [
    "CHECKSUM_KEY",
    "atomic_path",
    "check_sha256",
    "fsync_directory",
    "payload_sha256",
    "with_sha256",
    "write_atomic",
    "write_json_atomic",
]
