"""I/O faults injected into one rank, as real disks give them: ``fsync`` of a file or of a folder,
the host's own write, the marker's rename, or the marker's read failing with an errno (EIO, ENOSPC,
EDQUOT, EACCES). ``FAULT`` in a worker's environment names one (``what:ERRNO@rank``, e.g.
``fsync-file:EIO@1``); ``inject`` applies it for the length of a block, on the named rank only.

The errors carry the file's path as the kernel's would (``OSError(errno, strerror, path)``).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import stat
from typing import Iterator

KINDS = ("fsync-file", "fsync-dir", "write", "replace-marker", "read-marker")
MARKER = "dyn_plugin_checkpoint.json"


def parse(spec: str) -> tuple[str, int, int]:
    """``what:ERRNO@rank`` -> (what, errno, rank)."""
    what, rest = spec.split(":")
    name, rank = rest.split("@")
    assert what in KINDS, f"{what}: not one of {KINDS}"
    return what, getattr(errno, name), int(rank)


def _error(code: int, path: str) -> OSError:
    return OSError(code, os.strerror(code), path)


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@contextlib.contextmanager
def inject(spec: str | None, rank: int, where: str = "") -> Iterator[list[str]]:
    """Within the block, the fault ``spec`` strikes on ``rank`` (nothing where ``spec`` is None or
    names another rank), on paths that hold ``where``. Yields the paths it struck, in order."""
    struck: list[str] = []
    if spec is None or parse(spec)[2] != rank:
        yield struck
        return
    what, code, _ = parse(spec)
    saved = []

    def patch(owner, name, fn) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, fn)

    if what in ("fsync-file", "fsync-dir"):
        real_fsync = os.fsync
        want_dir = what == "fsync-dir"

        def fsync(fd):
            if stat.S_ISDIR(os.fstat(fd).st_mode) == want_dir and where in _fd_path(fd):
                struck.append(_fd_path(fd))
                raise _error(code, struck[-1])
            return real_fsync(fd)

        patch(os, "fsync", fsync)
    elif what == "write":
        import torch

        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            if isinstance(f, (str, os.PathLike)) and where in os.fspath(f):
                struck.append(os.fspath(f))
                with open(f, "wb") as out:  # half a file, then the disk is full
                    out.write(b"\0" * 100)
                raise _error(code, struck[-1])
            return real_save(obj, f, *args, **kwargs)

        patch(torch, "save", save)
    elif what == "replace-marker":
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if os.path.basename(os.fspath(dst)) == MARKER and where in os.fspath(dst):
                struck.append(os.fspath(dst))
                raise _error(code, struck[-1])
            return real_replace(src, dst, *args, **kwargs)

        patch(os, "replace", replace)
    elif what == "read-marker":
        real_open = builtins.open

        def open_(file, *args, **kwargs):
            if (
                isinstance(file, (str, os.PathLike))
                and os.path.basename(os.fspath(file)) == MARKER
                and where in os.fspath(file)
            ):
                mode = args[0] if args else kwargs.get("mode", "r")
                if "r" in mode:
                    struck.append(os.fspath(file))
                    raise _error(code, struck[-1])
            return real_open(file, *args, **kwargs)

        patch(builtins, "open", open_)
    try:
        yield struck
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
