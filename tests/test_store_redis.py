import logging
import socket
import threading
import time
import uuid

import numpy as np
import pytest
import redis
from pydantic import ValidationError

from dyn_plugin.config import mask_url
from dyn_plugin.store import (
    PayloadError,
    StoreAuthError,
    StoreConfig,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    decode,
    encode,
    open_store,
)
from dyn_plugin.store.redis_store import RedisPlanStore

PASSWORD_ENV = "DYN_PLUGIN_REDIS_PASSWORD"
SECRET = "a-shared-secret-of-32-characters"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in (PASSWORD_ENV, "DYN_PLUGIN_STORE_SECRET"):
        monkeypatch.delenv(name, raising=False)


def _config(server, **kw) -> StoreConfig:
    fields = {
        "backend": "redis",
        "url": server.url,
        "namespace": f"t{uuid.uuid4().hex[:8]}",
        "timeout_s": 2.0,
        "retries": 2,
        "retry_backoff_s": 0.05,
        **kw,
    }
    return StoreConfig(**fields)


@pytest.fixture
def store(redis_server, monkeypatch):  # noqa: F811
    monkeypatch.setenv(PASSWORD_ENV, redis_server.password)
    with open_store(_config(redis_server), rank=0, world_size=1) as s:
        yield s


def _raw(server) -> redis.Redis:
    return redis.Redis(port=server.port, password=server.password)


def test_put_get_wait_delete(store):
    assert isinstance(store, RedisPlanStore)
    assert store.get("plan/0") is None
    store.put("plan/0", b"\x00\xffplan")
    assert store.get("plan/0") == b"\x00\xffplan"
    assert store.wait("plan/0", timeout_s=1) == b"\x00\xffplan"
    store.delete("plan/0")
    store.delete("plan/0")
    assert store.get("plan/0") is None


def test_keys_are_namespaced_and_expire_by_default(store, redis_server):  # noqa: F811
    store.put("k", b"v")
    full = f"dynplugin/{store.namespace}/k"
    assert 3590_000 < _raw(redis_server).pttl(full) <= 3600_000


def test_ttl_expiry(store):
    store.put("short", b"v", ttl_s=0.3)
    assert store.get("short") == b"v"
    time.sleep(0.5)
    assert store.get("short") is None


def test_namespaces_do_not_see_each_other(store, redis_server):  # noqa: F811
    with open_store(_config(redis_server), rank=0, world_size=1) as other:
        store.put("k", b"mine")
        assert other.get("k") is None
        other.put("k", b"theirs")
        assert store.get("k") == b"mine"


def test_wait_returns_once_the_key_is_put(store):
    threading.Timer(0.2, store.put, args=("late", b"here")).start()
    t0 = time.monotonic()
    assert store.wait("late", timeout_s=5) == b"here"
    assert 0.15 < time.monotonic() - t0 < 1


def test_wait_honours_its_timeout(store, redis_server):  # noqa: F811
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout) as err:
        store.wait("never", timeout_s=0.3)
    assert 0.29 < time.monotonic() - t0 < 1.3
    msg = str(err.value)
    assert f"dynplugin/{store.namespace}/never" in msg and redis_server.url in msg and "0.3 s" in msg


def test_encoded_plan_round_trip(store):
    lengths = np.array([512, 77, 4096], dtype=np.int32)
    store.put("step/7", encode({"step": 7}, {"lengths": lengths}, schema="plan"))
    meta, arrays = decode(store.wait("step/7", 1), max_bytes=1 << 20, schema="plan")
    assert meta == {"step": 7}
    np.testing.assert_array_equal(arrays["lengths"], lengths)


def test_signed_values(redis_server, monkeypatch):  # noqa: F811
    monkeypatch.setenv(PASSWORD_ENV, redis_server.password)
    monkeypatch.setenv("DYN_PLUGIN_STORE_SECRET", SECRET)
    config = _config(redis_server)
    with open_store(config, rank=0, world_size=1) as signed:
        signed.put("k", b"plan")
        assert signed.get("k") == b"plan"
        _raw(redis_server).set(f"dynplugin/{config.namespace}/forged", b"\x01plan" + bytes(32))
        with pytest.raises(PayloadError, match="HMAC check failed"):
            signed.get("forged")
        _raw(redis_server).set(f"dynplugin/{config.namespace}/alien", b"written by something else")
        with pytest.raises(PayloadError, match="not written by a dyn-plugin PlanStore"):
            signed.get("alien")


def test_payloads_over_the_limit_are_refused(redis_server, monkeypatch):  # noqa: F811
    monkeypatch.setenv(PASSWORD_ENV, redis_server.password)
    with open_store(_config(redis_server, max_payload_mb=0.001), rank=0, world_size=1) as small:
        with pytest.raises(PayloadError, match="max_payload_mb"):
            small.put("big", bytes(2000))


# The same security floor as the TCP store: a server on a non-loopback address needs a password,
# the plans' HMAC secret and, with rediss://, TLS that checks certificates; refused before connecting.
@pytest.mark.parametrize(
    "url, env, refused",
    [
        (
            "redis://10.255.255.1:6379/0",
            {},
            ["$DYN_PLUGIN_REDIS_PASSWORD (store.password_env)", "$DYN_PLUGIN_STORE_SECRET (store.secret_env)"],
        ),
        ("redis://redis.example:6379/0", {PASSWORD_ENV: "pw"}, ["$DYN_PLUGIN_STORE_SECRET (store.secret_env)"]),
        ("redis://:hunter2@10.255.255.1:6379/0", {}, ["$DYN_PLUGIN_STORE_SECRET"]),
        ("redis://10.255.255.1:6379/0", {"DYN_PLUGIN_STORE_SECRET": SECRET}, ["$DYN_PLUGIN_REDIS_PASSWORD"]),
        (
            "rediss://10.255.255.1:6380/0?ssl_cert_reqs=none&ssl_check_hostname=False",
            {PASSWORD_ENV: "pw", "DYN_PLUGIN_STORE_SECRET": SECRET},
            ["drop ssl_cert_reqs=none, ssl_check_hostname=False from store.url"],
        ),
    ],
)
def test_non_loopback_redis_needs_password_secret_and_checked_tls(url, env, refused, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = StoreConfig(backend="redis", url=url, namespace="n", timeout_s=5.0)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="is not a loopback address") as err:
        open_store(config, rank=0, world_size=1)
    assert time.monotonic() - t0 < 0.5  # refused before any connection attempt
    msg = str(err.value)
    assert all(fix in msg for fix in refused), msg
    assert "hunter2" not in msg
    assert not isinstance(err.value, StoreUnavailable)


@pytest.mark.parametrize(
    "url, checked", [("rediss://redis.example:6380/0", True), ("redis://redis.example:6379/0", None)]
)
def test_tls_checks_the_servers_name_whatever_redis_pys_default(url, checked):
    """redis-py before 6 leaves ssl_check_hostname off by default (setup.py allows redis>=5): the
    store says it explicitly over rediss://."""
    from dyn_plugin.store.redis_store import RedisPlanStore

    config = StoreConfig(backend="redis", url=url, namespace="n", timeout_s=5.0)
    store = RedisPlanStore(config, password="pw", secret=None)  # no connection is made yet
    assert store._client.connection_pool.connection_kwargs.get("ssl_check_hostname") is checked


def test_non_loopback_redis_with_password_and_secret_is_served(redis_server, monkeypatch):  # noqa: F811
    monkeypatch.setenv(PASSWORD_ENV, redis_server.password)
    monkeypatch.setenv("DYN_PLUGIN_STORE_SECRET", SECRET)
    # '127.1' reaches the test server but is not a literal loopback address, so the floor applies
    with open_store(_config(redis_server, url=f"redis://127.1:{redis_server.port}/0"), rank=0, world_size=1) as s:
        s.put("k", b"signed")
        assert s.get("k") == b"signed"
        assert _raw(redis_server).get(f"dynplugin/{s.namespace}/k").startswith(b"\x01")  # HMAC-signed


def _bytes_sent(server) -> int:
    return int(_raw(server).info("stats")["total_net_output_bytes"])


@pytest.mark.parametrize("secret", [None, SECRET])
def test_values_over_the_limit_are_refused_before_reading(redis_server, monkeypatch, secret):  # noqa: F811
    monkeypatch.setenv(PASSWORD_ENV, redis_server.password)
    if secret is not None:
        monkeypatch.setenv("DYN_PLUGIN_STORE_SECRET", secret)
    with open_store(_config(redis_server, max_payload_mb=1), rank=0, world_size=1) as s:
        limit = 2**20
        s.put("at-limit", bytes(limit))  # stored with its flag byte (and tag): still within the limit
        assert len(s.get("at-limit")) == limit
        full = f"dynplugin/{s.namespace}/big"
        _raw(redis_server).set(full, b"\x00" + bytes(8 * limit))  # written by something that ignores the limit
        for read in (lambda: s.get("big"), lambda: s.wait("big", 1)):
            sent = _bytes_sent(redis_server)
            with pytest.raises(
                PayloadError, match=f"'{full}' .* holds {8 * limit + 1} bytes, over store.max_payload_mb"
            ):
                read()
            assert _bytes_sent(redis_server) - sent < 64 * 1024  # the 8 MiB never left the server


def test_wrong_password(redis_server, monkeypatch):  # noqa: F811
    monkeypatch.setenv(PASSWORD_ENV, "not-the-password")
    with pytest.raises(StoreAuthError, match=f"refused authentication.*check \\${PASSWORD_ENV}"):
        open_store(_config(redis_server), rank=0, world_size=1)


def test_bench_loader_names_a_wrong_password_in_one_line_before_it_runs(redis_server, monkeypatch, capsys):  # noqa: F811
    from dyn_plugin.cli import main

    monkeypatch.setenv(PASSWORD_ENV, "not-the-password")
    assert main(["bench", "loader", "--redis-url", redis_server.url]) == 2
    out, err = capsys.readouterr()
    assert not out and len(err.strip().splitlines()) == 1 and "refused authentication" in err, err


def test_missing_password(redis_server):  # noqa: F811
    with pytest.raises(StoreAuthError, match=f"set \\${PASSWORD_ENV}"):
        open_store(_config(redis_server), rank=0, world_size=1)


def test_password_in_the_url_works_but_warns_and_is_masked(redis_server, caplog):  # noqa: F811
    url = f"redis://:{redis_server.password}@127.0.0.1:{redis_server.port}/0"
    with caplog.at_level(logging.WARNING, logger="dyn_plugin.store"):
        with open_store(_config(redis_server, url=url), rank=0, world_size=1) as s:
            s.put("k", b"v")
            assert s.get("k") == b"v"
            assert s.address == f"redis://:***@127.0.0.1:{redis_server.port}/0"
    assert "contains a password" in caplog.text
    assert redis_server.password not in caplog.text


def test_the_env_password_beats_the_urls(redis_server, monkeypatch):  # noqa: F811
    monkeypatch.setenv(PASSWORD_ENV, redis_server.password)
    url = f"redis://:stale-password@127.0.0.1:{redis_server.port}/0"
    with open_store(_config(redis_server, url=url), rank=0, world_size=1) as s:
        assert s.get("k") is None


def test_config_never_shows_the_urls_password():
    config = StoreConfig(backend="redis", url="redis://:hunter2@h:6379/0")
    assert "hunter2" not in repr(config) and "hunter2" not in str(config)
    with pytest.raises(ValidationError) as err:
        StoreConfig(backend="redis", url="redis://:hunter2@h:x/0")
    assert "hunter2" not in str(err.value)


def test_server_killed_mid_run(fresh_redis_server, monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, fresh_redis_server.password)
    url = f"redis://:{fresh_redis_server.password}@127.0.0.1:{fresh_redis_server.port}/0"
    config = _config(fresh_redis_server, url=url, timeout_s=1.0)
    with open_store(config, rank=0, world_size=1) as s:
        s.put("k", b"v")
        fresh_redis_server.kill()
        for call in (lambda: s.get("k"), lambda: s.wait("k", 30), lambda: s.put("k", b"v")):
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable) as err:
                call()
            assert time.monotonic() - t0 < config.timeout_s + 0.5
            assert mask_url(url) in str(err.value) and fresh_redis_server.password not in str(err.value)


def test_unreachable_url_fails_quickly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    config = StoreConfig(
        backend="redis",
        url=f"redis://127.0.0.1:{port}/0",
        namespace="n",
        timeout_s=5.0,
        retries=2,
        retry_backoff_s=0.05,
    )
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"redis://127.0.0.1:{port}/0 unavailable during ping.*3 attempt"):
        open_store(config, rank=0, world_size=1)
    assert time.monotonic() - t0 < 1.5  # refused connections do not wait out timeout_s


def test_mask_url():
    assert mask_url("redis://h:6379/0") == "redis://h:6379/0"
    assert mask_url("rediss://user:p%40ss@h:6380/1") == "rediss://user:***@h:6380/1"
    assert mask_url("redis://:pw@[::1]:6379") == "redis://:***@[::1]:6379"


def test_backend_none_and_missing_namespace():
    assert open_store(StoreConfig(), rank=0, world_size=1) is None
    with pytest.raises(StoreError, match="namespace is not set"):
        open_store(StoreConfig(backend="redis", url="redis://h:1/0"), rank=0, world_size=1)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"backend": "redis"}, "needs 'url'"),
        ({"backend": "redis", "url": "http://h:1"}, "must start with redis:// or rediss://.*scheme .http."),
        ({"url": "redis://h:1/0"}, "backend is 'none'; set backend='redis'"),
        ({"backend": "redis", "url": "redis://h:1/0", "port": 6379}, "'port' is only used by backend 'tcp'"),
        ({"backend": "redis", "url": "redis://h:1/0", "ttl_s": -1}, "greater than 0"),
        ({"backend": "redis", "url": "redis://h:1/0", "retries": -1}, "greater than or equal to 0"),
        ({"backend": "redis", "url": "redis://h:1/0", "password_env": "not a name"}, "pattern"),
    ],
)
def test_config_validation(fields, match):
    with pytest.raises(ValidationError, match=match):
        StoreConfig(**fields)
