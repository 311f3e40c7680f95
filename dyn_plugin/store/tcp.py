"""Backend 'tcp': torch's TCPStore, hosted inside rank 0's process.

Nothing extra to deploy, and nothing to clean up: the server lives and dies with rank 0,
so a dead run leaves no keys behind (and TCPStore has no expiry, so ``ttl_s`` is unused;
consumers delete plans they are done with). The flip side: when rank 0 dies the store is
gone, and every call elsewhere fails with :class:`StoreUnavailable`.

Port: ``store.port`` if set; else ``MASTER_PORT + 1`` when the launcher exported
``MASTER_PORT`` (every rank sees the same value, and the port next to the rendezvous one is
usually free too); else :data:`DEFAULT_PORT`. Port 0 takes any free port, which only rank 0
knows (``.port``), so it suits single-process use and tests.

Security: TCPStore has no authentication. torch's own server listens on every interface
whatever host it is given, so rank 0 binds the listening socket itself, to ``store.host``
only, and hands it over; on a non-loopback host a shared secret (every value HMAC-signed)
is mandatory.

Size: libuv's TCPStore server drops the connection on any frame over 8 MiB, so a value larger
than ``FRAME_BYTES`` is stored as chunks under keys of its own, and its key holds a head naming
them, written last (a reader never sees a head before its chunks). ``max_payload_mb`` is checked
from the head before a chunked value is read, else once a value has arrived (Redis checks before;
see redis_store.py).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

from torch.distributed import DistError, DistNetworkError, DistStoreError, TCPStore

from ..config import StoreConfig
from .base import PlanStore, StoreError, StoreUnavailable, check_remote_floor, is_loopback

logger = logging.getLogger(__name__)

DEFAULT_PORT = 29511
# compare_set(key, _ABSENT, _ABSENT) reads a key without blocking and without creating it:
# TCPStore returns the stored value, or _ABSENT when the key is missing. Stored values
# start with a 0x00/0x01 flag byte (see base.PlanStore), so none can equal _ABSENT.
_ABSENT = b"\xff"
# libuv's server refuses frames over 8 MiB (key and value): values above this go as chunks
FRAME_BYTES = 4 << 20
# the first byte of a chunked value's head (its JSON follows: chunk count, bytes, the chunks' key prefix)
_CHUNKED = b"\x02"


def resolve_port(config: StoreConfig) -> int:
    """The port every rank agrees on without talking to each other (module docstring)."""
    if config.port is not None:
        return config.port
    master_port = os.environ.get("MASTER_PORT")
    if not master_port:
        return DEFAULT_PORT
    try:
        port = int(master_port) + 1
    except ValueError:
        raise StoreError(f"MASTER_PORT={master_port!r} is not a port number; fix it or set store.port") from None
    if not 0 < port <= 65535:
        raise StoreError(f"MASTER_PORT={master_port} + 1 is not a valid port; set store.port")
    return port


def _first_line(exc: BaseException) -> str:
    # torch appends a C++ backtrace to the message; the first line is the useful part.
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


class TCPPlanStore(PlanStore):
    def __init__(
        self, store: TCPStore, *, host: str, namespace: str, secret: bytes | None, max_payload_bytes: int
    ) -> None:
        super().__init__(
            namespace=namespace,
            address=f"tcp://{host}:{store.port}",
            secret=secret,
            max_payload_bytes=max_payload_bytes,
        )
        self._store: TCPStore | None = store

    @property
    def port(self) -> int:
        """The port actually in use (what port 0 resolved to)."""
        return int(self._require().port)

    @classmethod
    def open(cls, config: StoreConfig, *, rank: int, world_size: int, secret: bytes | None) -> "TCPPlanStore":
        host, port = config.host, resolve_port(config)
        check_remote_floor(
            config, host, what=f"store.host={host} (port {port}; TCPStore has no authentication)", secret=secret
        )
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if is_loopback(host) and local.isdigit() and int(local) < world_size:
            raise StoreError(
                f"store.host={host} is a loopback address but the run spans nodes (LOCAL_WORLD_SIZE={local}, "
                f"world_size={world_size}): set store.host to rank 0's address (e.g. $MASTER_ADDR) and ${config.secret_env}"
            )
        if rank == 0:
            store = _serve(host, port, config.timeout_s)
            logger.info("rank 0 hosts the plan store at tcp://%s:%d", host, store.port)
        elif port == 0:
            raise StoreError(f"rank {rank} cannot connect to port 0: set store.port to the port rank 0 bound")
        else:
            store = _connect(host, port, config.timeout_s, config.retry_backoff_s)
        assert config.namespace is not None
        return cls(
            store, host=host, namespace=config.namespace, secret=secret, max_payload_bytes=config.max_payload_bytes
        )

    def close(self) -> None:
        # Dropping the last reference stops rank 0's server; TCPStore has no close().
        self._store = None

    def _require(self) -> TCPStore:
        if self._store is None:
            raise StoreError(f"{self!r} is closed")
        return self._store

    @contextmanager
    def _calling(self, op: str, full_key: str) -> Iterator[TCPStore]:
        store = self._require()
        try:
            yield store
        except DistNetworkError as exc:
            raise StoreUnavailable(
                f"plan store at {self.address} went away during {op} of '{full_key}' ({_first_line(exc)}); "
                "it lives in rank 0's process, so rank 0 has most likely exited"
            ) from None
        except DistError as exc:
            raise StoreError(f"{op} of '{full_key}' on {self.address} failed: {_first_line(exc)}") from None

    def _put(self, full_key: str, value: bytes, ttl_s: float | None) -> None:
        with self._calling("put", full_key) as store:
            if len(value) > FRAME_BYTES:
                prefix = f"{full_key}/#chunk-{os.urandom(6).hex()}"
                chunks = range(0, len(value), FRAME_BYTES)
                for i, start in enumerate(chunks):  # one connection: the server applies them before the head
                    store.set(f"{prefix}/{i}", value[start : start + FRAME_BYTES])
                value = _CHUNKED + json.dumps({"chunks": len(chunks), "bytes": len(value), "prefix": prefix}).encode()
            store.set(full_key, value)
            # TCPStore.set is fire-and-forget: a get on another connection could overtake it.
            # A reply on this connection means the server has applied the set.
            store.check([full_key])

    def _read(self, store: TCPStore, key: str) -> bytes | None:
        value = store.compare_set(key, _ABSENT, _ABSENT)
        return None if value == _ABSENT else value

    def _get(self, full_key: str) -> bytes | None:
        with self._calling("get", full_key) as store:
            value = self._read(store, full_key)
            if value is None or not value.startswith(_CHUNKED):
                return value
            head = json.loads(value[1:])
            if head["bytes"] > self._max_stored_bytes:
                raise self._too_big(full_key, head["bytes"])
            parts = [self._read(store, f"{head['prefix']}/{i}") for i in range(head["chunks"])]
        if any(p is None for p in parts):
            return None  # deleted while it was read
        value = b"".join(parts)  # type: ignore[arg-type]
        if len(value) != head["bytes"]:
            raise StoreError(
                f"'{full_key}' on {self.address} holds {len(value)} bytes in chunks, its head says {head['bytes']}"
            )
        return value

    def _wait(self, full_key: str, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        # Loop because a key can be deleted between TCPStore.wait returning and the read.
        while (value := self._get(full_key)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout(full_key, timeout_s)
            with self._calling("wait", full_key) as store:
                try:
                    store.wait([full_key], timedelta(seconds=remaining))
                except DistStoreError:
                    raise self._timeout(full_key, timeout_s) from None
        return value

    def _delete(self, full_key: str) -> None:
        with self._calling("delete", full_key) as store:
            value = self._read(store, full_key)
            store.delete_key(full_key)
            if value is not None and value.startswith(_CHUNKED):
                head = json.loads(value[1:])
                for i in range(head["chunks"]):
                    store.delete_key(f"{head['prefix']}/{i}")


def _serve(host: str, port: int, timeout_s: float) -> TCPStore:
    """Start the server on a socket bound to ``host`` only (torch would bind all interfaces)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise StoreUnavailable(f"rank 0 cannot resolve store.host={host}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
        bound = sock.getsockname()[1]
        store = TCPStore(
            address[0],
            bound,
            None,
            True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=sock.fileno(),
        )
    except (OSError, DistError) as exc:
        sock.close()
        raise StoreUnavailable(
            f"rank 0 cannot host the plan store on {host}:{port} ({_first_line(exc)}); set store.port to a free port "
            "or store.host to an address of rank 0's node"
        ) from None
    sock.detach()  # the server owns the descriptor now and closes it when it stops
    return store


def _connect(host: str, port: int, timeout_s: float, poll_s: float) -> TCPStore:
    """Connect to rank 0's server, waiting for it to come up, but never past ``timeout_s``.

    TCPStore's own connect loop overruns its timeout (about 1.6x measured), so a plain
    socket probe does the waiting and TCPStore only connects once something listens.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(remaining, 0.01)).close()
            break
        except OSError as exc:
            if time.monotonic() + poll_s >= deadline:
                raise StoreUnavailable(
                    f"no plan store at tcp://{host}:{port} after {timeout_s:g} s ({exc}); it is hosted by rank 0: "
                    "check rank 0 is alive and every rank has the same store.host and store.port"
                ) from None
            time.sleep(max(poll_s, 0.01))
    try:
        store = TCPStore(host, port, None, False, timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.1)))
    except DistError as exc:
        raise StoreUnavailable(f"cannot connect to the plan store at tcp://{host}:{port}: {_first_line(exc)}") from None
    store.set_timeout(timedelta(seconds=timeout_s))
    return store
