"""Round-trip latency of the plan stores, for ``dynplugin bench loader``.

A training rank pays one ``get`` (or ``wait``) per step on top of the planner's ``put``,
so put+get of a plan-sized payload is the number that matters.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

import numpy as np

from ..config import StoreConfig
from ..store.base import PlanStore
from ..store.factory import open_store
from ..store.redis_server import RedisServer, RedisServerNotFound
from ..store.redis_store import RedisPlanStore

_WARMUP = 10


def round_trip_latency(store: PlanStore, *, payload_bytes: int, count: int) -> dict:
    """p50/p99 in ms of ``put`` then ``get`` of a ``payload_bytes`` payload, over ``count`` rounds."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    payload = os.urandom(payload_bytes)
    key = f"bench/{payload_bytes}"
    times = []
    for i in range(_WARMUP + count):
        t0 = time.perf_counter()
        store.put(key, payload)
        got = store.get(key)
        elapsed = time.perf_counter() - t0
        if got != payload:
            raise RuntimeError(f"{store!r} returned a different payload for {key!r}")
        if i >= _WARMUP:
            times.append(elapsed * 1e3)
    store.delete(key)
    p50, p99 = np.percentile(times, [50, 99])
    return {"payload_bytes": payload_bytes, "count": count, "p50_ms": float(p50), "p99_ms": float(p99)}


def check_redis(url: str) -> None:
    """Connect to the Redis server at ``url`` (password from $DYN_PLUGIN_REDIS_PASSWORD) and go:
    StoreUnavailable or StoreAuthError, each one line, if it cannot be used."""
    with RedisPlanStore.open(StoreConfig(backend="redis", url=url, namespace="bench-check"), secret=None):
        pass


def bench_stores(
    count: int = 200, payload_bytes: Sequence[int] = (1024, 65536), redis_url: str | None = None
) -> list[dict]:
    """Both backends on this machine: a loopback TCPStore and Redis, at ``redis_url`` (its password
    from $DYN_PLUGIN_REDIS_PASSWORD, store.password_env's default) or else a throwaway local
    redis-server. With neither, the Redis row says how to add one instead of failing."""
    namespace = f"bench-{os.getpid()}"
    rows = []
    tcp = open_store(StoreConfig(backend="tcp", namespace=namespace, port=0), rank=0, world_size=1)
    assert tcp is not None
    with tcp:
        rows += [{"backend": "tcp", **round_trip_latency(tcp, payload_bytes=n, count=count)} for n in payload_bytes]

    def redis_rows(url: str, password: str | None) -> list[dict]:
        config = StoreConfig(backend="redis", url=url, namespace=namespace)
        with RedisPlanStore.open(config, password=password, secret=None) as redis_store:
            return [
                {"backend": "redis", **round_trip_latency(redis_store, payload_bytes=n, count=count)}
                for n in payload_bytes
            ]

    if redis_url is not None:
        return rows + redis_rows(redis_url, None)
    try:
        server = RedisServer()  # finds the binary; the with block starts it
    except RedisServerNotFound as exc:
        return rows + [
            {
                "backend": "redis",
                "skipped": f"{exc}; or measure a running server with "
                "`dynplugin bench loader --redis-url redis://HOST:PORT` (password in $DYN_PLUGIN_REDIS_PASSWORD)",
            }
        ]
    with server:
        return rows + redis_rows(server.url, server.password)
