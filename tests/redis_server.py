"""Fixtures that run a real redis-server (see dyn_plugin.store.redis_server) and prove it is gone afterwards.

conftest.py registers this module (``pytest_plugins``), so every test module can ask for the fixtures.
A missing binary fails the tests with install instructions instead of skipping them.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from dyn_plugin.store.redis_server import RedisServer, RedisServerNotFound


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run() -> Iterator[RedisServer]:
    try:
        server = RedisServer().start()
    except RedisServerNotFound as exc:
        pytest.fail(f"redis-server is a test dependency: {exc}", pytrace=False)
    pid = server.pid
    try:
        yield server
    finally:
        server.stop()
        assert not _alive(pid), f"redis-server pid {pid} is still running after teardown"


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """One server shared by a module's tests (they use distinct namespaces)."""
    yield from _run()


@pytest.fixture
def fresh_redis_server() -> Iterator[RedisServer]:
    """A server of the test's own, for tests that kill it."""
    yield from _run()
