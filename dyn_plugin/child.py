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
    """A TCP port on loopback that nothing listens on right now, drawn below the kernel's ephemeral
    range: a port from ``bind(("", 0))`` comes from that range, where every outgoing connection
    (gloo opens many) can take it between this check and the caller's listen (EADDRINUSE)."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    low = max(10000, ephemeral_low - 20000)
    draw = random.Random()  # seeded from the OS: a test's random.seed cannot make two callers agree
    for _ in range(64) if ephemeral_low > low else ():
        port = draw.randrange(low, ephemeral_low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
