"""A step's micro-batches fed to the device one ahead: each is copied while the one before computes.

On CUDA a micro-batch's tensors are pinned (page-locked host memory, from which a copy runs
asynchronously; a copy from pageable memory blocks the host until it is done) and copied on a side
stream as soon as the previous micro-batch is handed out, so the copy overlaps that micro-batch's
forward and backward instead of stalling the device queue ahead of its own. The compute stream waits
for the copy with an event-like ``wait_stream`` (no host sync), and each device tensor is recorded
on the compute stream so the caching allocator does not hand its memory out again while the
compute still reads it. Elsewhere (CPU, gloo tests) the tensors are moved as they are asked for.

Every host feeds its micro-batches through here: the token-mean step (DeepSpeed, FSDP) and Megatron's
planned data iterator.
"""

from __future__ import annotations

import contextlib
from typing import Any, Collection, Iterable, Iterator, Mapping

import torch


class DeviceFeed(Iterator[dict]):
    """``batches`` (dicts of host tensors and plain values) as dicts on ``device``, in order;
    ``keys``: the entries kept (None: all). Values that are not tensors, and the entries named in
    ``host_keys`` (lengths the consumer reads as Python ints: reading them from the device would
    sync), pass through unchanged."""

    def __init__(
        self,
        batches: Iterable[Mapping[str, Any]],
        device: torch.device,
        keys: Collection[str] | None = None,
        host_keys: Collection[str] = (),
    ) -> None:
        self._batches = iter(batches)
        self._device, self._keys, self._host_keys = device, keys, frozenset(host_keys)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ahead: dict | None = None
        self._issue()

    def _issue(self) -> None:
        """Start moving the next batch (on CUDA: pinned, on the side stream); None at the end."""
        batch = next(self._batches, None)
        if batch is None:
            self._ahead = None
            return
        kept = {k: v for k, v in batch.items() if self._keys is None or k in self._keys}
        moved = [k for k, v in kept.items() if _host_tensor(v) and k not in self._host_keys]
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            self._ahead = {**kept, **{k: copy_to(kept[k], self._device) for k in moved}}

    def __next__(self) -> dict:
        if self._ahead is None:
            raise StopIteration
        ready = self._ahead
        if self._stream is not None:
            compute = torch.cuda.current_stream(self._device)
            compute.wait_stream(self._stream)
            for v in ready.values():
                if torch.is_tensor(v) and v.device == compute.device:
                    v.record_stream(compute)
        self._issue()  # the next copy runs while the caller computes on this one
        return ready


def copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the host) on ``device`` without blocking the host: on CUDA a non-blocking copy
    from pinned memory, on the current stream (a blocking copy waits for every kernel queued on the
    stream before it; one from pageable memory is staged by the host first). torch's pinned-memory
    allocator keeps the pinned copy until the transfer has read it."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _host_tensor(v: Any) -> bool:
    return torch.is_tensor(v) and v.device.type == "cpu"


__all__ = ["DeviceFeed", "copy_to"]
