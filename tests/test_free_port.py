"""Ports for a test's own rendezvous come from below the kernel's ephemeral range, where no outgoing
connection can take them between the draw and the listen (a family-matrix cell once lost its port
that way to one of gloo's connections: EADDRINUSE)."""

import socket

import pytest

from dyn_plugin.child import free_port


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range on this system")


def test_ports_are_drawn_below_the_ephemeral_range_and_are_free():
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(p < low for p in ports), (ports, low)
    assert len(ports) > 1  # drawn, not one fixed port that two concurrent tests would share
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_someone_listens_on_is_never_returned(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        draws = iter([busy, busy + 1 if busy + 1 < 65536 else busy - 1])

        class Draw:
            def randrange(self, *_):
                return next(draws)

        monkeypatch.setattr("random.Random", Draw)
        # the busy port is in the ephemeral range here; pretend the range starts above it
        monkeypatch.setattr("builtins.open", _range_file(busy + 2), raising=True)
        assert free_port() != busy


def _range_file(low: int):
    import builtins
    import io

    real = builtins.open

    def fake(path, *a, **k):
        if path == "/proc/sys/net/ipv4/ip_local_port_range":
            return io.StringIO(f"{low}\t60999\n")
        return real(path, *a, **k)

    return fake
