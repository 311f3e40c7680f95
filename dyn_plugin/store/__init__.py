"""Sharing plans between planner processes and training ranks.

``open_store(config, rank=..., world_size=...)`` gives a :class:`PlanStore` (or None for
backend 'none'); :func:`encode` / :func:`decode` turn plans into bytes and back. The
backends (torch TCPStore, Redis) are imported only when opened, so importing this package
pulls in neither torch.distributed nor a Redis client.
"""

from ..config import StoreConfig  # what open_store takes
from .base import (
    PayloadError,
    PlanStore,
    StoreAuthError,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
)
from .factory import BACKENDS, open_store
from .payload import decode, encode

__all__ = [
    "BACKENDS",
    "PayloadError",
    "PlanStore",
    "StoreAuthError",
    "StoreConfig",
    "StoreError",
    "StoreTimeout",
    "StoreUnavailable",
    "decode",
    "encode",
    "open_store",
]
