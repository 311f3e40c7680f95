"""Backend 'redis': a Redis server shared by planners and ranks, possibly across runs.

Keys expire after ``ttl_s`` so a dead run leaves nothing behind. Every operation gets at
most ``1 + retries`` attempts and ``timeout_s`` in all (socket timeouts are a share of
it), so a server that is down or vanishes surfaces as :class:`StoreUnavailable`, never as
a hang. ``wait`` polls with a short capped backoff: plans are computed ahead, so the key
is usually there on the first read, and polling needs no extra keys or subscriptions.

A read checks the value's size on the server first (``STRLEN``, in the same script as the
``GET``, so nothing can be swapped in between): a value over ``max_payload_mb`` is refused
without downloading it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..config import StoreConfig, mask_url, with_password
from .base import PlanStore, StoreAuthError, StoreError, StoreUnavailable, check_remote_floor

logger = logging.getLogger(__name__)

T = TypeVar("T")
_POLL_FIRST_S = 0.001
_POLL_MAX_S = 0.05
# the value if it is at most ARGV[1] bytes, else its size (an integer), nil if missing; atomic
_GET_WITHIN = """
local size = redis.call('STRLEN', KEYS[1])
if size > tonumber(ARGV[1]) then return size end
return redis.call('GET', KEYS[1])
"""


class RedisPlanStore(PlanStore):
    def __init__(self, config: StoreConfig, *, password: str | None, secret: bytes | None) -> None:
        assert config.url is not None and config.namespace is not None
        super().__init__(
            namespace=config.namespace,
            address=mask_url(config.url),
            secret=secret,
            max_payload_bytes=config.max_payload_bytes,
        )
        self._config = config
        self._password_env = config.password_env
        url_password = urlsplit(config.url).password
        # redis-py lets a password in the URL beat the password argument; ours must win.
        password = password or (unquote(url_password) if url_password is not None else None)
        self._has_password = password is not None
        per_attempt_s = config.timeout_s / (config.retries + 1)
        # over TLS the server's name is checked against its certificate: said here, as redis-py before 6
        # leaves it off by default (a URL's own ssl_check_hostname still wins, refused off loopback)
        tls = {"ssl_check_hostname": True} if urlsplit(config.url).scheme == "rediss" else {}
        self._client = redis.Redis.from_url(
            with_password(config.url, None),
            password=password,
            socket_timeout=per_attempt_s,
            socket_connect_timeout=per_attempt_s,
            retry=Retry(NoBackoff(), 0),  # retries are ours, bounded by timeout_s
            **tls,
        )
        self._get_within = self._client.register_script(_GET_WITHIN)

    @classmethod
    def open(
        cls,
        config: StoreConfig,
        *,
        secret: bytes | None,
        password: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> "RedisPlanStore":
        """Connect and check the server answers; the password is ``password``, else ``$password_env``, else the URL's.
        ``rank`` and ``world_size`` (what ``open_store`` passes every backend) play no part: every process
        is a client."""
        assert config.url is not None
        password = password or os.environ.get(config.password_env) or None
        if urlsplit(config.url).password is not None:
            logger.warning(
                "store.url %s contains a password, which ends up in configs and logs; put it in $%s instead%s",
                mask_url(config.url),
                config.password_env,
                " (which is set and takes precedence)" if password else "",
            )
        check_remote_floor(
            config,
            urlsplit(config.url).hostname or "",
            what=f"store.url {mask_url(config.url)}",
            secret=secret,
            missing=_remote_requirements(config, has_password=password is not None),
        )
        store = cls(config, password=password, secret=secret)
        store._call("ping", "", store._client.ping)
        logger.info("plan store: redis at %s, namespace %s", store.address, config.namespace)
        return store

    def close(self) -> None:
        self._client.close()

    def _call(self, op: str, full_key: str, fn: Callable[[], T], deadline: float | None = None) -> T:
        """``fn()`` with bounded retries on connection errors, all before ``deadline``."""
        start = time.monotonic()
        deadline = min(deadline or float("inf"), start + self._config.timeout_s)
        what = f"{op} of '{full_key}'" if full_key else op
        attempt = 0
        while True:
            try:
                return fn()
            except redis.AuthenticationError as exc:
                # Before ConnectionError: redis-py makes AuthenticationError a subclass of it.
                fix = (
                    f"check ${self._password_env} holds its password"
                    if self._has_password
                    else f"set ${self._password_env} to its password"
                )
                raise StoreAuthError(f"redis at {self.address} refused authentication ({exc}): {fix}") from None
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                pause = self._config.retry_backoff_s * 2**attempt
                if attempt == self._config.retries or time.monotonic() + pause >= deadline:
                    raise StoreUnavailable(
                        f"redis at {self.address} unavailable during {what}: {exc} "
                        f"({attempt + 1} attempt(s) in {time.monotonic() - start:.1f} s)"
                    ) from None
                logger.debug("redis %s failed (%s); retry %d in %.2f s", what, exc, attempt + 1, pause)
                time.sleep(pause)
                attempt += 1
            except redis.RedisError as exc:
                raise StoreError(f"redis at {self.address} failed {what}: {exc}") from None

    def _put(self, full_key: str, value: bytes, ttl_s: float | None) -> None:
        ttl_ms = max(1, round((ttl_s if ttl_s is not None else self._config.ttl_s) * 1000))
        self._call("put", full_key, lambda: self._client.set(full_key, value, px=ttl_ms))

    def _get(self, full_key: str, deadline: float | None = None) -> bytes | None:
        limit = self._max_stored_bytes
        value = self._call("get", full_key, lambda: self._get_within(keys=[full_key], args=[limit]), deadline)
        if isinstance(value, int):
            raise self._too_big(full_key, value)
        return value

    def _wait(self, full_key: str, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        pause = _POLL_FIRST_S
        while (value := self._get(full_key, deadline)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout(full_key, timeout_s)
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, _POLL_MAX_S)
        return value

    def _delete(self, full_key: str) -> None:
        self._call("delete", full_key, lambda: self._client.delete(full_key))


# TLS settings redis-py reads from a rediss:// URL's query that switch its checks off
_WEAK_TLS = {"ssl_cert_reqs": {"none", "optional"}, "ssl_check_hostname": {"false", "f", "no", "n", "0"}}


def _remote_requirements(config: StoreConfig, *, has_password: bool) -> list[str]:
    """What a Redis reachable from other hosts lacks beyond the shared secret, each as its fix:
    a password, and, where TLS is configured (rediss://), TLS that checks the server's certificate
    (without it, whoever sits in between reads the password and the plans)."""
    assert config.url is not None
    parts = urlsplit(config.url)
    fixes = []
    if not has_password and parts.password is None:
        fixes.append(f"set ${config.password_env} (store.password_env) to the server's password (its requirepass)")
    if parts.scheme == "rediss":
        weak = sorted(
            f"{name}={values[0]}"
            for name, values in parse_qs(parts.query).items()
            if values[0].lower() in _WEAK_TLS.get(name, ())
        )
        if weak:
            fixes.append(f"drop {', '.join(weak)} from store.url so TLS checks the server's certificate")
    return fixes
