"""Every rank learns every rank's outcome before any goes on: errors are exchanged, never raised alone.

A rank that raises alone leaves the others inside their next collective until the process group's
timeout (under NCCL without its watchdog, for ever). So each step of a protocol that can fail on
one rank (a file it cannot read, sync or write) ends in ``gather``: every rank hands in what it
found, or the error it hit (``attempt``), and ``raise_any`` raises the same error on every rank
when any rank hit one. Without a process group (one process) the exchange is the rank itself.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def group() -> tuple[int, int]:
    """(this rank, the world size): (0, 1) without a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather(obj: Any) -> list[Any]:
    """``obj`` from every rank, in rank order (picklable; on the device the backend takes)."""
    import torch.distributed as dist

    rank, world = group()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def attempt(fn: Callable[[], T], what: str) -> tuple[T | None, str | None]:
    """``fn()``, or its error in words prefixed by ``what`` (the rank and the step that failed): an
    error to hand to ``gather``, not to raise here."""
    try:
        return fn(), None
    except Exception as exc:  # every failure: one rank raising alone is what this module prevents
        rank, _ = group()
        logger.debug("rank %d: %s failed", rank, what, exc_info=True)
        return None, f"rank {rank}: {what}: {describe(exc)}"


def describe(exc: BaseException) -> str:
    """An error in one line: its type where the message does not say it (an OSError's strerror does);
    the ranks' own errors inside one that gathered them (torch.distributed.checkpoint's)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:  # CheckpointException: rank -> (exception, traceback)
        return "; ".join(
            f"rank {r}: {describe(f[0] if isinstance(f, tuple) else f)}" for r, f in sorted(failures.items())
        )
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.strerror} (errno {exc.errno}): {exc.filename}"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def raise_any(errors: list[str | None], make: Callable[[str], Exception]) -> None:
    """Raise ``make(message)`` when any rank reported an error: the same errors, in rank order, on
    every rank that gathered them."""
    found = [e for e in errors if e is not None]
    if found:
        raise make("; ".join(found))
