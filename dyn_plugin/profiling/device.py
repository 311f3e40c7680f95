"""Where the profiler measures, in which precision, and how a step is timed and weighed there.

CPU: wall clock, and live tensor bytes from :class:`~dyn_plugin.profiling.memory.LiveMemory`
(CPU has no allocator statistics). CUDA: CUDA events (kernels run asynchronously, so a host
clock would time their launch, not their run) and the caching allocator's statistics.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..cost.profile import DeviceInfo
from ..device import DTYPES

# first() -> value, second(value) -> None; returns (ms of first, ms of second)
Clock = Callable[[Callable[[], Any], Callable[[Any], None]], tuple[float, float]]
# forward() -> loss, backward(loss) -> None; returns (stored bytes after forward, peak bytes above the start)
MemoryProbe = Callable[[Callable[[], Any], Callable[[Any], None]], tuple[float, float]]


@dataclass(frozen=True)
class Target:
    """The device and the precision (the config's cost_model.dtype literals) of a profile."""

    device: torch.device
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def info(self) -> DeviceInfo:
        if self.device.type == "cuda":
            name = torch.cuda.get_device_name(self.device)
        else:
            name = platform.processor() or platform.machine()
        return DeviceInfo(
            type=self.device.type, name=name, dtype=self.dtype, threads=torch.get_num_threads(), torch=torch.__version__
        )

    def synchronize(self) -> None:
        """Wait for the device's queued work (before reading a host clock)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def resolve_target(device: str | None = None, dtype: str | None = None) -> Target:
    """``device`` defaults to cuda when there is one, else cpu; ``dtype`` to bf16 on CUDA, fp32 on CPU."""
    try:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise ValueError(f"--device {device!r}: not a torch device; use cuda, cuda:N or cpu") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this torch ({torch.__version__}) sees no CUDA device; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this host has {torch.cuda.device_count()} CUDA devices (cuda:0 ...)")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    measures(dev.type)  # refuse a device the profiler cannot measure before building anything
    dtype = dtype or ("bf16" if dev.type == "cuda" else "fp32")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: allowed are {', '.join(DTYPES)}")
    return Target(dev, dtype)


def wall_clock(first: Callable[[], Any], second: Callable[[Any], None]) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = first()
    t1 = time.perf_counter()
    second(out)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def cuda_clock(first: Callable[[], Any], second: Callable[[Any], None]) -> tuple[float, float]:
    """Event-timed: an event completes when the GPU reaches it, so the span covers the kernels'
    run, and the host launching slower than the GPU runs shows as the GPU waiting."""
    start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record()
    out = first()
    mid.record()
    second(out)
    end.record()
    end.synchronize()
    return start.elapsed_time(mid), mid.elapsed_time(end)


def live_memory(forward: Callable[[], Any], backward: Callable[[Any], None]) -> tuple[float, float]:
    from .memory import LiveMemory

    with LiveMemory() as mem:
        base = mem.live
        loss = forward()
        stored = mem.live - base
        mem.reset_peak()
        backward(loss)
        peak = mem.peak - base
        del loss
    return float(stored), float(max(peak, stored))


def cuda_allocator_memory(forward: Callable[[], Any], backward: Callable[[Any], None]) -> tuple[float, float]:
    """The same two figures from the caching allocator's counters (bytes held by tensors)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    loss = forward()
    stored = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()  # the peak restarts from what is allocated now
    backward(loss)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del loss
    return float(stored), float(max(peak, stored))


_MEASURES: dict[str, tuple[Clock, MemoryProbe]] = {
    "cpu": (wall_clock, live_memory),
    "cuda": (cuda_clock, cuda_allocator_memory),
}


def measures(device_type: str) -> tuple[Clock, MemoryProbe]:
    """The clock and the memory probe for tensors on ``device_type``."""
    try:
        return _MEASURES[device_type]
    except KeyError:
        raise ValueError(
            f"the profiler measures on {' or '.join(_MEASURES)}, not {device_type!r}; "
            "pass --device cpu or --device cuda"
        ) from None
