"""The plan store interface, its configuration, its errors, and ``open_store``.

Planner processes ``put`` encoded plans; training ranks ``wait`` for them. Every key is
prefixed ``dynplugin/{namespace}/`` so runs sharing a server never see each other's plans.

When a shared secret is set (env var named by ``secret_env``), every value is stored as
``flag | payload | HMAC-SHA256(key, payload)``: the tag binds the full key, so a value
cannot be forged, altered, or replayed under another key (say, an older step's plan).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
from abc import ABC, abstractmethod
from typing import Any, Iterator, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger(__name__)

KEY_PREFIX = "dynplugin"
MIN_SECRET_BYTES = 16

_UNSIGNED, _SIGNED = b"\x00", b"\x01"
_TAG_BYTES = hashlib.sha256().digest_size


class StoreError(RuntimeError):
    """Any plan-store failure; the message names the key and the backend address."""


class StoreUnavailable(StoreError):
    """The backend cannot be reached (down, gone away, or never there)."""


class StoreAuthError(StoreError):
    """The backend refused our credentials."""


class StoreTimeout(StoreError):
    """``wait`` ran out of time before the key appeared."""


class PayloadError(StoreError):
    """A payload is malformed, too big, or fails its signature check."""


def with_password(url: str, password: str | None) -> str:
    """``url`` with its password replaced (None: removed), user, host and port kept."""
    parts = urlsplit(url)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname or ""
    auth = (parts.username or "") + (f":{password}" if password is not None else "")
    netloc = (f"{auth}@" if auth else "") + host + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, fit for messages and logs."""
    return url if urlsplit(url).password is None else with_password(url, "***")


class StoreConfig(BaseModel):
    """Where plans are shared between planner processes and training ranks."""

    # hide_input_in_errors: a rejected url may carry a password; keep it out of error text.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    backend: Literal["none", "tcp", "redis"] = Field(
        default="none",
        description="'none' (plan on every rank, share nothing), 'tcp' (torch TCPStore hosted by rank 0) or 'redis' (a Redis server at url)",
    )
    namespace: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$",
        description="run id in every key (dynplugin/{namespace}/...); must be unique per training run, the launcher derives one when unset",
    )
    host: str = Field(default="127.0.0.1", min_length=1, description="tcp: address rank 0 binds and other ranks connect to")
    port: int | None = Field(
        default=None, ge=0, le=65535,
        description="tcp: port; unset = MASTER_PORT+1 if MASTER_PORT is set, else 29511; 0 = any free port (rank 0 only, read it from the store's .port)",
    )
    url: str | None = Field(default=None, description="redis: redis://host:port/db or rediss://host:port/db for TLS")
    password_env: str = Field(
        default="DYN_PLUGIN_REDIS_PASSWORD", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="redis: name of the env var holding the password (kept out of configs and logs)",
    )
    secret_env: str = Field(
        default="DYN_PLUGIN_STORE_SECRET", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description=f"name of the env var holding a shared secret (>= {MIN_SECRET_BYTES} chars) that HMAC-signs every value; required for tcp on a non-loopback host",
    )
    timeout_s: float = Field(default=30.0, gt=0, description="longest any store operation (connect included) may take before failing")
    retries: int = Field(default=3, ge=0, le=100, description="redis: retries of an operation after a connection error, within timeout_s")
    retry_backoff_s: float = Field(
        default=0.1, ge=0,
        description="first pause between retries, doubling each time (redis); tcp clients poll rank 0 this often while it starts",
    )
    ttl_s: float = Field(default=3600.0, gt=0, description="redis: seconds a plan lives, so a dead run leaves nothing behind (tcp: the store dies with rank 0)")
    max_payload_mb: float = Field(default=64.0, gt=0, description="largest value put or accepted, MiB")

    @model_validator(mode="after")
    def _fields_match_backend(self) -> "StoreConfig":
        # A url with the default backend 'none' would silently share nothing: refuse it.
        owners = {"url": "redis", "host": "tcp", "port": "tcp"}
        for name in sorted(self.model_fields_set & owners.keys()):
            if owners[name] != self.backend:
                raise ValueError(f"'{name}' is only used by backend '{owners[name]}' but backend is '{self.backend}'; set backend='{owners[name]}' or drop '{name}'")
        if self.backend == "redis":
            if not self.url:
                raise ValueError("backend 'redis' needs 'url', e.g. redis://host:6379/0 (rediss:// for TLS)")
            if not self.url.startswith(("redis://", "rediss://")):
                raise ValueError(f"url must start with redis:// or rediss:// (TLS), not with scheme '{urlsplit(self.url).scheme}'")
            try:
                parts = urlsplit(self.url)
                parts.port  # noqa: B018 -- parsing the port is the check
            except ValueError as exc:
                raise ValueError(f"url is not a valid redis URL ({exc}); expected redis://host:port/db") from None
            if not parts.hostname:
                raise ValueError("url has no host; expected redis://host:port/db")
        return self

    @property
    def max_payload_bytes(self) -> int:
        return int(self.max_payload_mb * 2**20)

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # repr() lands in logs: never with the url's password.
        for name, value in super().__repr_args__():
            yield name, mask_url(value) if name == "url" and value else value


class PlanStore(ABC):
    """A tiny key-value store for encoded plans; keys are relative to the run's namespace."""

    def __init__(self, *, namespace: str, address: str, secret: bytes | None, max_payload_bytes: int) -> None:
        self.namespace = namespace
        self.address = address  # for messages: never contains a password
        self._secret = secret
        self._max_bytes = max_payload_bytes

    def put(self, key: str, payload: bytes, ttl_s: float | None = None) -> None:
        """Store ``payload`` under ``key``; ``ttl_s`` overrides the configured expiry (redis only)."""
        full = self._full_key(key)
        if len(payload) > self._max_bytes:
            raise PayloadError(f"payload for '{full}' is {len(payload)} bytes, over store.max_payload_mb ({self._max_bytes} bytes); raise it or shrink the plan")
        self._put(full, self._seal(full, bytes(payload)), ttl_s)

    def get(self, key: str) -> bytes | None:
        """The payload under ``key``, or None if there is none; never blocks on a missing key."""
        full = self._full_key(key)
        raw = self._get(full)
        return None if raw is None else self._unseal(full, raw)

    def wait(self, key: str, timeout_s: float) -> bytes:
        """Block until ``key`` exists and return its payload; :class:`StoreTimeout` after ``timeout_s``."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        full = self._full_key(key)
        return self._unseal(full, self._wait(full, timeout_s))

    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""
        self._delete(self._full_key(key))

    @abstractmethod
    def close(self) -> None:
        """Release connections (tcp rank 0: stops the server, which ends the store for everyone)."""

    def __enter__(self) -> "PlanStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address}, namespace={self.namespace!r})"

    def _full_key(self, key: str) -> str:
        if not isinstance(key, str) or not key:
            raise ValueError(f"store keys must be non-empty strings, got {key!r}")
        return f"{KEY_PREFIX}/{self.namespace}/{key}"

    def _timeout(self, full_key: str, timeout_s: float) -> StoreTimeout:
        return StoreTimeout(f"no value for key '{full_key}' on {self.address} after waiting {timeout_s:g} s")

    def _mac(self, full_key: str, payload: bytes) -> bytes:
        assert self._secret is not None
        key = full_key.encode()  # length-prefixed, so no (key, payload) split is ambiguous
        return hmac.new(self._secret, len(key).to_bytes(4, "little") + key + payload, hashlib.sha256).digest()

    def _seal(self, full_key: str, payload: bytes) -> bytes:
        if self._secret is None:
            return _UNSIGNED + payload
        return _SIGNED + payload + self._mac(full_key, payload)

    def _unseal(self, full_key: str, raw: bytes) -> bytes:
        flag, body = raw[:1], raw[1:]
        if flag == _UNSIGNED and self._secret is None:
            payload = body
        elif flag == _SIGNED and self._secret is not None and len(body) >= _TAG_BYTES:
            payload, tag = body[:-_TAG_BYTES], body[-_TAG_BYTES:]
            if not hmac.compare_digest(tag, self._mac(full_key, payload)):
                raise PayloadError(f"HMAC check failed for '{full_key}' on {self.address}: forged, altered, or signed with another secret")
        elif flag == _SIGNED and self._secret is None:
            raise PayloadError(f"'{full_key}' on {self.address} is signed but this process has no secret: set the store.secret_env variable on every rank")
        elif flag == _UNSIGNED:
            raise PayloadError(f"'{full_key}' on {self.address} is not signed but this process requires signatures: set the same secret on every rank and planner")
        else:
            raise PayloadError(f"'{full_key}' on {self.address} was not written by a dyn-plugin PlanStore")
        if len(payload) > self._max_bytes:
            raise PayloadError(f"'{full_key}' on {self.address} holds {len(payload)} bytes, over store.max_payload_mb ({self._max_bytes} bytes)")
        return payload

    @abstractmethod
    def _put(self, full_key: str, value: bytes, ttl_s: float | None) -> None: ...

    @abstractmethod
    def _get(self, full_key: str) -> bytes | None: ...

    @abstractmethod
    def _wait(self, full_key: str, timeout_s: float) -> bytes: ...

    @abstractmethod
    def _delete(self, full_key: str) -> None: ...


def read_secret(config: StoreConfig) -> bytes | None:
    """The shared signing secret from the env var ``config.secret_env``, or None if unset."""
    value = os.environ.get(config.secret_env, "")
    if not value:
        return None
    if len(value.encode()) < MIN_SECRET_BYTES:
        raise StoreError(
            f"${config.secret_env} is {len(value)} chars; use at least {MIN_SECRET_BYTES}, "
            "e.g. python -c 'import secrets; print(secrets.token_hex(32))'"
        )
    return value.encode()


def open_store(config: StoreConfig, *, rank: int, world_size: int) -> PlanStore | None:
    """Open the configured store for this process, or None for backend 'none'.

    With backend 'tcp', rank 0 hosts the server (and must outlive the others' use of it);
    every other rank, and every planner process, connects as a client.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if config.backend == "none":
        return None
    if config.namespace is None:
        raise StoreError("store.namespace is not set: give each training run its own id (e.g. the job id) so runs sharing a server never mix plans")
    secret = read_secret(config)
    if config.backend == "tcp":
        from .tcp import TCPPlanStore

        return TCPPlanStore.open(config, rank=rank, world_size=world_size, secret=secret)
    from .redis_store import RedisPlanStore

    return RedisPlanStore.open(config, secret=secret)
