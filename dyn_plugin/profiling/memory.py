"""Live tensor memory, measured on any device (CPU included) by watching every op.

CUDA has allocator statistics; CPU has none. This mode records the storage each op allocates
and notices when it dies, so it knows the bytes alive at every op: what a forward leaves for
backward (stored activations) and the high-water mark (peak). Only the measuring pass runs
under it: it slows ops down, so timings are taken separately.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


class LiveMemory(TorchDispatchMode):
    """Bytes of tensor storage allocated under this mode and still alive.

    ``live`` is current; ``peak`` is the high-water mark since the last :meth:`reset_peak`.
    Storages that existed before the mode (weights, inputs) are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self._storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._live = 0
        self.peak = 0

    def _on_free(self, nbytes: int) -> None:
        self._live -= nbytes

    @property
    def live(self) -> int:
        return self._live

    def reset_peak(self) -> None:
        self.peak = self._live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                if storage in self._storages:
                    continue
                nbytes = storage.nbytes()
                self._storages[storage] = nbytes
                self._live += nbytes
                # The finalizer runs when the storage (not this Python wrapper) is freed.
                torch.utils.weak.weakref.finalize(storage, self._on_free, nbytes)
        self.peak = max(self.peak, self._live)
        return out
