"""The plan store interface, its configuration and its errors (``open_store`` is in factory.py).

Planner processes ``put`` encoded plans; training ranks ``wait`` for them. Every key is
prefixed ``dynplugin/{namespace}/`` so runs sharing a server never see each other's plans.

When a shared secret is set (env var named by ``secret_env``), every value is stored as
``flag | payload | HMAC-SHA256(key, payload)``: the tag binds the full key, so a value
cannot be forged, altered, or replayed under another key (say, an older step's plan).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
from abc import ABC, abstractmethod

from ..config import MIN_SECRET_BYTES, StoreConfig

logger = logging.getLogger(__name__)

KEY_PREFIX = "dynplugin"

_UNSIGNED, _SIGNED = b"\x00", b"\x01"
_TAG_BYTES = hashlib.sha256().digest_size


class StoreError(RuntimeError):
    """Any plan-store failure; the message names the key and the backend address."""


class StoreUnavailable(StoreError, ConnectionError):
    """The backend cannot be reached (down, gone away, or never there). A ConnectionError too: the
    environment's fault, which the CLI reports as one line, not as an internal error."""


class StoreAuthError(StoreError, PermissionError):
    """The backend refused our credentials (a PermissionError too, for the same reason)."""


class StoreTimeout(StoreError):
    """``wait`` ran out of time before the key appeared."""


class PayloadError(StoreError):
    """A payload is malformed, too big, or fails its signature check."""


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
            raise PayloadError(
                f"payload for '{full}' is {len(payload)} bytes, over store.max_payload_mb ({self._max_bytes} bytes); raise it or shrink the plan"
            )
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

    @property
    def _max_stored_bytes(self) -> int:
        """The largest value a payload within the limit is stored as (flag byte, and tag if signed)."""
        return len(_UNSIGNED) + self._max_bytes + (_TAG_BYTES if self._secret is not None else 0)

    def _too_big(self, full_key: str, stored_bytes: int) -> PayloadError:
        return PayloadError(
            f"'{full_key}' on {self.address} holds {stored_bytes} bytes, over store.max_payload_mb "
            f"({self._max_bytes} bytes); raise it if plans are this big"
        )

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
                raise PayloadError(
                    f"HMAC check failed for '{full_key}' on {self.address}: forged, altered, or signed with another secret"
                )
        elif flag == _SIGNED and self._secret is None:
            raise PayloadError(
                f"'{full_key}' on {self.address} is signed but this process has no secret: set the store.secret_env variable on every rank"
            )
        elif flag == _UNSIGNED:
            raise PayloadError(
                f"'{full_key}' on {self.address} is not signed but this process requires signatures: set the same secret on every rank and planner"
            )
        else:
            raise PayloadError(f"'{full_key}' on {self.address} was not written by a dyn-plugin PlanStore")
        if len(payload) > self._max_bytes:
            raise self._too_big(full_key, len(payload))
        return payload

    @abstractmethod
    def _put(self, full_key: str, value: bytes, ttl_s: float | None) -> None: ...

    @abstractmethod
    def _get(self, full_key: str) -> bytes | None: ...

    @abstractmethod
    def _wait(self, full_key: str, timeout_s: float) -> bytes: ...

    @abstractmethod
    def _delete(self, full_key: str) -> None: ...


def is_loopback(host: str) -> bool:
    """Only literal loopback addresses and 'localhost' count; any other name may be remote."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_remote_floor(
    config: StoreConfig, host: str, *, what: str, secret: bytes | None, missing: list[str] | None = None
) -> None:
    """The one security floor of every backend: a store on a non-loopback ``host`` can be reached
    by other machines, so every plan must be HMAC-signed with the shared secret and the backend's
    own requirements (``missing``: each unmet one as its fix, e.g. Redis's password) must be met.
    ``what`` names the store and why it is exposed. A single-node run keeps the store on loopback
    and needs none of it.
    """
    if is_loopback(host):
        return
    fixes = list(missing or [])
    if secret is None:
        fixes.append(
            f"set ${config.secret_env} (store.secret_env) to the same secret (>= {MIN_SECRET_BYTES} chars) on "
            "every rank so every plan is HMAC-signed"
        )
    if fixes:
        raise StoreError(
            f"{what} is not a loopback address, so anyone who can reach it could write plans: "
            + "; ".join(fixes)
            + ". On a single node use 127.0.0.1 instead"
        )


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
