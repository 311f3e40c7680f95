"""Keep glibc from returning memory to the OS between micro-batches.

With variable shapes, glibc's malloc serves large tensors by mmap and frees them by munmap,
so each micro-batch of a new size page-faults its activations in again; on the machines
measured here that made a step up to 30% slower depending on what ran before it, which no
cost model can predict. Fixing the mmap and trim thresholds (what MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ do) keeps freed memory in the heap for reuse. The profiler and the
training runtime both call this, so measured and predicted steps run under the same allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_MAX = 32 << 20  # glibc's ceiling for the mmap threshold on 64-bit
_applied = False


def stable_cpu_allocator() -> bool:
    """Apply once per process; False where the C library is not glibc."""
    global _applied
    if _applied:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.debug("no glibc mallopt; allocator left as is")
        return False
    ok = all(
        mallopt(param, value)
        for param, value in ((_M_MMAP_THRESHOLD, _MMAP_MAX), (_M_TRIM_THRESHOLD, 1 << 31), (_M_TOP_PAD, 256 << 20))
    )
    _applied = ok
    logger.debug("glibc malloc thresholds fixed: %s", ok)
    return ok
