import multiprocessing
import socket
import threading
import time
import uuid

import numpy as np
import pytest
from pydantic import ValidationError
from torch.distributed import TCPStore

from dyn_plugin.store import (
    PayloadError,
    StoreConfig,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    decode,
    encode,
    open_store,
)
from dyn_plugin.store.tcp import DEFAULT_PORT, TCPPlanStore, resolve_port

SECRET = "a-shared-secret-of-32-characters"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("DYN_PLUGIN_STORE_SECRET", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _config(**kw) -> StoreConfig:
    return StoreConfig(**{"backend": "tcp", "namespace": f"t{uuid.uuid4().hex[:8]}", "port": 0, "timeout_s": 2.0, **kw})


@pytest.fixture
def pair():
    """Rank 0 (hosting) and rank 1 (client) in this process."""
    config = _config()
    with open_store(config, rank=0, world_size=2) as rank0:
        with open_store(config.model_copy(update={"port": rank0.port}), rank=1, world_size=2) as rank1:
            yield rank0, rank1


def test_put_get_wait_delete(pair):
    rank0, rank1 = pair
    assert isinstance(rank0, TCPPlanStore) and rank0.address == f"tcp://127.0.0.1:{rank0.port}"
    assert rank1.get("plan/0") is None
    rank0.put("plan/0", b"\x00\xffplan", ttl_s=5)  # ttl_s is accepted and unused: the store dies with rank 0
    assert rank1.get("plan/0") == b"\x00\xffplan"
    assert rank1.wait("plan/0", timeout_s=1) == b"\x00\xffplan"
    rank1.put("empty", b"")
    assert rank0.get("empty") == b""
    rank1.delete("plan/0")
    rank1.delete("plan/0")  # deleting a missing key is fine
    assert rank0.get("plan/0") is None


def test_a_put_is_visible_to_other_connections_once_it_returns(pair):
    # TCPStore.set alone is fire-and-forget; without put's acknowledgement about 1 in
    # 400 gets on the other connection overtook the set.
    rank0, rank1 = pair
    misses = 0
    for i in range(2000):
        rank0.put(f"k{i}", b"v")
        misses += rank1.get(f"k{i}") is None
    assert misses == 0


def test_namespaces_do_not_see_each_other(pair):
    rank0, _ = pair
    other = open_store(_config(port=rank0.port), rank=1, world_size=2)
    rank0.put("k", b"mine")
    assert other.get("k") is None
    other.put("k", b"theirs")
    assert rank0.get("k") == b"mine"


def test_wait_returns_once_the_key_is_put(pair):
    rank0, rank1 = pair
    threading.Timer(0.2, rank0.put, args=("late", b"here")).start()
    t0 = time.monotonic()
    assert rank1.wait("late", timeout_s=5) == b"here"
    assert 0.15 < time.monotonic() - t0 < 2


def test_wait_honours_its_timeout(pair):
    _, rank1 = pair
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout) as err:
        rank1.wait("never", timeout_s=0.3)
    assert 0.29 < time.monotonic() - t0 < 1.3
    msg = str(err.value)
    assert "dynplugin/" in msg and "/never" in msg and rank1.address in msg and "0.3 s" in msg


def test_payloads_over_the_limit_are_refused():
    with open_store(_config(max_payload_mb=0.001), rank=0, world_size=1) as small:
        with pytest.raises(PayloadError, match="max_payload_mb"):
            small.put("big", bytes(2000))


def test_encoded_plan_round_trip(pair):
    rank0, rank1 = pair
    plan = {"micro_batches": np.array([[0, 3], [3, 7]], dtype=np.int64), "lengths": np.arange(7, dtype=np.int32)}
    rank0.put("step/1", encode({"step": 1}, plan, schema="plan"))
    meta, arrays = decode(rank1.wait("step/1", 1), max_bytes=1 << 20, schema="plan")
    assert meta == {"step": 1}
    np.testing.assert_array_equal(arrays["micro_batches"], plan["micro_batches"])


def _listen_address(port: int) -> str:
    """Local address of the socket listening on ``port``, from /proc/net/tcp (Linux)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.split(":")[1], 16) == port:
                    return local.split(":")[0]
    raise AssertionError(f"nothing listens on port {port}")


def test_rank0_listens_on_loopback_only(pair):
    # torch's TCPStore would listen on every interface; ours must not.
    rank0, _ = pair
    assert _listen_address(rank0.port) == "0100007F"  # 127.0.0.1, little-endian hex


def test_non_loopback_host_needs_a_secret():
    with pytest.raises(StoreError, match="DYN_PLUGIN_STORE_SECRET.*HMAC-signed"):
        open_store(_config(host="10.11.12.13"), rank=0, world_size=2)


def test_short_secret_is_refused(monkeypatch):
    monkeypatch.setenv("DYN_PLUGIN_STORE_SECRET", "short")
    with pytest.raises(StoreError, match="at least 16"):
        open_store(_config(), rank=0, world_size=1)


def test_loopback_host_in_a_multi_node_run_is_refused(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(StoreError, match="spans nodes"):
        open_store(_config(), rank=3, world_size=16)


def test_hmac_signed_round_trip_and_forgeries(monkeypatch):
    monkeypatch.setenv("DYN_PLUGIN_STORE_SECRET", SECRET)
    config = _config()
    with open_store(config, rank=0, world_size=2) as rank0:
        rank1 = open_store(config.model_copy(update={"port": rank0.port}), rank=1, world_size=2)
        rank0.put("step/1", b"signed plan")
        assert rank1.get("step/1") == b"signed plan"

        raw = TCPStore("127.0.0.1", rank0.port, None, False)
        prefix = f"dynplugin/{config.namespace}/"
        signed = raw.get(prefix + "step/1")
        assert signed.startswith(b"\x01") and len(signed) == 1 + len(b"signed plan") + 32

        raw.set(prefix + "step/2", signed)  # replay under another key
        with pytest.raises(PayloadError, match="HMAC check failed"):
            rank1.get("step/2")
        raw.set(prefix + "step/3", signed.replace(b"signed", b"forged"))
        with pytest.raises(PayloadError, match="HMAC check failed"):
            rank1.wait("step/3", 1)
        raw.set(prefix + "step/4", b"\x00unsigned plan")
        with pytest.raises(PayloadError, match="not signed"):
            rank1.get("step/4")

        monkeypatch.delenv("DYN_PLUGIN_STORE_SECRET")
        no_secret = open_store(config.model_copy(update={"port": rank0.port}), rank=1, world_size=2)
        with pytest.raises(PayloadError, match="no secret"):
            no_secret.get("step/1")


def test_port_resolution(monkeypatch):
    assert resolve_port(StoreConfig(backend="tcp")) == DEFAULT_PORT
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert resolve_port(StoreConfig(backend="tcp")) == 29501
    assert resolve_port(StoreConfig(backend="tcp", port=4000)) == 4000
    monkeypatch.setenv("MASTER_PORT", "x")
    with pytest.raises(StoreError, match="MASTER_PORT"):
        resolve_port(StoreConfig(backend="tcp"))


def test_port_0_only_for_rank_0():
    with pytest.raises(StoreError, match="port 0"):
        open_store(_config(), rank=1, world_size=2)


def test_port_in_use_is_reported():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(StoreUnavailable, match="cannot host the plan store.*store.port"):
            open_store(_config(port=busy.getsockname()[1]), rank=0, world_size=2)


def test_no_master_gives_unavailable_within_the_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"no plan store at tcp://127.0.0.1:{port}.*rank 0"):
        open_store(_config(port=port, timeout_s=0.5), rank=1, world_size=2)
    assert time.monotonic() - t0 < 1.5


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"port": 70000}, "less than or equal to 65535"),
        ({"timeout_s": 0}, "greater than 0"),
        ({"namespace": "a/b"}, "pattern"),
        ({"url": "redis://h:1/0"}, "'url' is only used by backend 'redis'"),
        ({"bogus": 1}, "Extra inputs"),
    ],
)
def test_config_validation(fields, match):
    with pytest.raises(ValidationError, match=match):
        StoreConfig(**{"backend": "tcp", **fields})


def _rank0_process(namespace: str, ports) -> None:
    store = open_store(StoreConfig(backend="tcp", namespace=namespace, port=0, timeout_s=5), rank=0, world_size=2)
    ports.put(store.port)
    store.put("hello", b"from rank 0")
    store.put("echo", store.wait("ping", 20)[::-1])
    time.sleep(60)  # host the store until the test kills this process


def test_client_in_another_process_and_master_death():
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    namespace = f"t{uuid.uuid4().hex[:8]}"
    proc = ctx.Process(target=_rank0_process, args=(namespace, ports), daemon=True)
    proc.start()
    try:
        port = ports.get(timeout=60)
        config = StoreConfig(backend="tcp", namespace=namespace, port=port, timeout_s=1.0)
        rank1 = open_store(config, rank=1, world_size=2)
        assert rank1.wait("hello", 20) == b"from rank 0"
        rank1.put("ping", b"abc")
        assert rank1.wait("echo", 20) == b"cba"

        proc.kill()
        proc.join()
        for call in (lambda: rank1.get("hello"), lambda: rank1.wait("never", 30), lambda: rank1.put("x", b"")):
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable, match=f"tcp://127.0.0.1:{port}.*rank 0"):
                call()
            assert time.monotonic() - t0 < 1.5
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            open_store(config, rank=1, world_size=2)
        assert time.monotonic() - t0 < 1.5
    finally:
        proc.kill()
        proc.join()


def test_values_over_the_servers_frame_go_as_chunks(pair):
    """libuv's TCPStore server drops the connection on a frame over 8 MiB (a 9 MiB plan failed as
    "rank 0 has most likely exited", and planners retried it for ever): such values go as chunks,
    their head written last, and a delete takes the chunks too."""
    rank0, rank1 = pair
    big = bytes(range(256)) * (9 * 2**20 // 256 + 5)
    rank1.put("plan/big", big)  # from a client, as planner processes put
    assert rank0.get("plan/big") == big and rank1.wait("plan/big", timeout_s=2) == big
    raw = rank0._store
    assert raw.num_keys() > 3  # the chunks are keys of their own
    rank1.delete("plan/big")
    assert rank0.get("plan/big") is None and raw.num_keys() <= 1


def test_a_chunked_value_over_the_limit_is_refused_before_it_is_read(pair):
    rank0, rank1 = pair
    rank0.put("plan/big", bytes(9 * 2**20))
    small = TCPPlanStore(
        rank1._store, host="127.0.0.1", namespace=rank1.namespace, secret=None, max_payload_bytes=2**20
    )
    with pytest.raises(PayloadError, match=r"holds 9437185 bytes, over store.max_payload_mb"):
        small.get("plan/big")


def test_a_plan_over_max_payload_mb_stops_its_planner_which_is_not_retried(caplog):
    """The planner process refuses a plan over the limit naming its size and the limit, and exits;
    the ranks plan those steps themselves (the same plans) instead of waiting on it."""
    from dyn_plugin.runtime.loader import DynLoader
    from test_loader import make

    cfg, cm, lens, data = make(store={"backend": "tcp", "port": 0, "max_payload_mb": 0.0005})
    loader = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, seed=7)
    try:
        with caplog.at_level("WARNING"):
            steps = [s.digest for s in loader]
    finally:
        loader.close()
    alone = DynLoader(data, lengths=lens, config=make()[0], cost_model=cm, seed=7)
    assert steps == [s.digest for s in alone]
    said = [r.getMessage() for r in caplog.records if "max_payload_mb" in r.getMessage()]
    assert said and "planner process 0" in said[0] and "exited with code 1" in said[0], caplog.text
    assert "bytes, over store.max_payload_mb (524 bytes)" in said[0]
