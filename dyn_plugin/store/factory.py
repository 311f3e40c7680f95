"""``open_store``: the plan store ``store.backend`` names, opened for this process.

Every backend is one entry of ``BACKENDS``: where its :class:`~dyn_plugin.store.base.PlanStore`
class lives, imported only when opened, so importing this package pulls in neither
torch.distributed nor a Redis client. A backend's class opens with
``open(config, *, rank, world_size, secret)``. The config's ``store.backend`` names are checked
against ``BACKENDS`` (tests/test_config.py).
"""

from __future__ import annotations

import importlib

from ..config import StoreConfig
from .base import PlanStore, StoreError, read_secret

# store.backend -> "module:class" of its PlanStore (the module relative to this package); None: no store
BACKENDS: dict[str, str | None] = {
    "none": None,  # plan on every rank, share nothing
    "tcp": ".tcp:TCPPlanStore",  # a torch TCPStore hosted by rank 0
    "redis": ".redis_store:RedisPlanStore",  # a Redis server at store.url
}


def open_store(config: StoreConfig, *, rank: int, world_size: int) -> PlanStore | None:
    """Open the configured store for this process, or None for backend 'none'.

    With backend 'tcp', rank 0 hosts the server (and must outlive the others' use of it);
    every other rank, and every planner process, connects as a client.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if config.backend not in BACKENDS:
        raise StoreError(f"unknown store.backend {config.backend!r}; known: {', '.join(BACKENDS)}")
    where = BACKENDS[config.backend]
    if where is None:
        return None
    if config.namespace is None:
        raise StoreError(
            "store.namespace is not set: give each training run its own id (e.g. the job id) so runs "
            "sharing a server never mix plans"
        )
    secret = read_secret(config)
    module, _, name = where.partition(":")
    store_class = getattr(importlib.import_module(module, __package__), name)
    return store_class.open(config, rank=rank, world_size=world_size, secret=secret)
