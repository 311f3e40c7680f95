"""Values derived from the one tensor every layer of a forward (and its recompute) receives.

Attention layers all get the same ``position_ids`` or boundaries tensor within one forward. What is
derived from it (the documents' offsets, whose longest document is a host read; flex's block masks)
is computed at the first layer that asks and reused until another tensor arrives: once per forward,
not per layer.
"""

from __future__ import annotations

import weakref
from typing import Callable, Hashable, TypeVar

import torch

T = TypeVar("T")
_NO_TENSOR = object()  # the layers pass None (one document per row): a source of its own


class PerForward:
    """Values keyed by ``key`` for the tensor layers currently pass, matched by identity and held
    weakly (a finished forward's tensors are freed, and a dead one never matches)."""

    def __init__(self) -> None:
        self._source: object = None  # weakref.ref, _NO_TENSOR, or None before the first call
        self._values: dict[Hashable, object] = {}

    def get(self, tensor: torch.Tensor | None, key: Hashable, compute: Callable[[], T]) -> T:
        if not self._holds(tensor):
            self._source = _NO_TENSOR if tensor is None else weakref.ref(tensor)
            self._values = {}
        if key not in self._values:
            self._values[key] = compute()
        return self._values[key]  # type: ignore[return-value]

    def _holds(self, tensor: torch.Tensor | None) -> bool:
        if tensor is None:
            return self._source is _NO_TENSOR
        return isinstance(self._source, weakref.ref) and self._source() is tensor
