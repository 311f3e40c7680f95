"""Time marks around a step's micro-batches, for the timings hosts record (bench traces, online
calibration): the host's clock on CPU, CUDA events on a GPU (the host's clock there times kernel
launches, not kernels), read once after the step."""

from __future__ import annotations

import time
from typing import Any

import torch


class StepClock:
    """Marks when ``enabled`` (else ``mark`` returns None and costs nothing); ``wait`` once after the
    step before reading them with ``ms``."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.cuda, self.enabled = device.type == "cuda", enabled

    def mark(self) -> Any:
        if not self.enabled:
            return None
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


class PeakMemory:
    """The device's peak allocated bytes over a step: the allocator's own count on a GPU (read on the
    host, no synchronisation), None elsewhere (a CPU allocator keeps none)."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device, self.enabled = device, enabled and device.type == "cuda"
        if self.enabled:
            torch.cuda.reset_peak_memory_stats(device)

    def read(self) -> float | None:
        return float(torch.cuda.max_memory_allocated(self.device)) if self.enabled else None
