"""Live tensor memory, measured on any device (CPU included) by watching every op.

CUDA has allocator statistics; CPU has none. This mode records the storage each op allocates
and notices when it dies, so it knows the bytes alive at every op: what a forward leaves for
backward (stored activations) and the high-water mark (peak). Only the measuring pass runs
under it: it slows ops down, so timings are taken separately.

Storages resized in place are followed too: FSDP2 frees a unit's gathered parameters with
``untyped_storage().resize_(0)`` and re-allocates them the same way, which no op reports, so
``UntypedStorage.resize_`` is wrapped while the mode is active.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


class LiveMemory(TorchDispatchMode):
    """Bytes of tensor storage allocated under this mode and still alive.

    ``live`` is current; ``peak`` is the high-water mark since the last :meth:`reset_peak`.
    Storages that existed before the mode (weights, inputs) are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self._storages: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [its bytes now]
        self._live = 0
        self.peak = 0
        self._resize = None

    def _on_free(self, nbytes: list[int]) -> None:
        self._live -= nbytes[0]

    def __enter__(self) -> "LiveMemory":
        resize = self._resize = torch.UntypedStorage.resize_

        def resized(storage, size):
            out = resize(storage, size)
            nbytes = self._storages.get(storage)
            if nbytes is not None:
                self._live += size - nbytes[0]
                nbytes[0] = size
                self.peak = max(self.peak, self._live)
            return out

        torch.UntypedStorage.resize_ = resized
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*exc)

    @property
    def live(self) -> int:
        return self._live

    def reset_peak(self) -> None:
        self.peak = self._live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            # a view or an in-place result: its storage is an input's, not a new allocation (a
            # weight viewed by ``t()`` in a linear's forward is not the forward's memory)
            return out
        for t in _plain(tree_flatten(out)[0]):
            storage = t.untyped_storage()
            if storage in self._storages:
                continue
            nbytes = [storage.nbytes()]
            self._storages[storage] = nbytes
            self._live += nbytes[0]
            # The finalizer runs when the storage (not this Python wrapper) is freed.
            torch.utils.weak.weakref.finalize(storage, self._on_free, nbytes)
        self.peak = max(self.peak, self._live)
        return out


def _plain(tensors) -> Iterator[torch.Tensor]:
    """The plain tensors that hold memory: tensors themselves, the inner tensors of wrapper
    subclasses (a DTensor's local shard: the op that made it ran inside DTensor's dispatch, where
    this mode does not see it; the wrapper's own storage has its full shape and holds no data).
    Other subclasses (FakeTensor) hold no memory."""
    for t in tensors:
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            yield from _plain(getattr(t, n) for n in names)
        elif type(t) is torch.Tensor and not t.is_meta:
            yield t
