"""Helper processes (planners, profiling load, collective benchmarks) that die with their parent."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGTERM this process when ``parent`` dies; elsewhere callers poll
    ``os.getppid()`` as well."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # died before prctl took effect
        sys.exit(0)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
