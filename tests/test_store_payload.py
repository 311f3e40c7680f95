import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dyn_plugin.store import PayloadError, decode, encode
from dyn_plugin.store import payload as wire

MAX = 1 << 20
SECRET = b"0123456789abcdef-test-secret"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
metas = st.dictionaries(st.text(max_size=8), json_values, max_size=5)
arrays = st.dictionaries(
    st.text(max_size=8),
    st.sampled_from(sorted(wire.DTYPES)).flatmap(
        lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6))
    ),
    max_size=4,
)


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for name, array in want.items():
        # Bytes, not values: NaN payloads and -0.0 must survive bit for bit.
        assert got[name].dtype == array.dtype and got[name].shape == array.shape
        assert got[name].tobytes() == array.tobytes()


@settings(max_examples=150, deadline=None)
@given(meta=metas, arrs=arrays, secret=st.none() | st.binary(min_size=1, max_size=48), schema=st.text(max_size=10))
def test_round_trip(meta, arrs, secret, schema):
    data = encode(meta, arrs, secret=secret, schema=schema)
    got_meta, got_arrays = decode(data, max_bytes=len(data), secret=secret, schema=schema)
    assert got_meta == meta
    _same(got_arrays, arrs)


@settings(max_examples=50, deadline=None)
@given(arrs=arrays, data=st.data())
def test_any_flipped_byte_of_a_signed_payload_is_rejected(arrs, data):
    payload = bytearray(encode({"step": 1}, arrs, secret=SECRET))
    i = data.draw(st.integers(0, len(payload) - 1))
    payload[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(PayloadError):
        decode(bytes(payload), max_bytes=MAX, secret=SECRET)


def test_arrays_are_aligned_read_only_views():
    data = encode({}, {"a": np.arange(3, dtype=np.int8), "b": np.arange(5, dtype=np.float64)})
    _, got = decode(data, max_bytes=MAX)
    for array in got.values():
        assert array.flags.aligned and not array.flags.writeable


def test_big_endian_and_strided_inputs_round_trip():
    big = np.arange(6, dtype=">i4").reshape(2, 3)
    strided = np.arange(20, dtype=np.float32)[::3]
    _, got = decode(encode({}, {"big": big, "strided": strided}), max_bytes=MAX)
    np.testing.assert_array_equal(got["big"], big)
    np.testing.assert_array_equal(got["strided"], strided)


# --- helpers that build payloads with a hand-edited header -------------------------------


def _split(data: bytes) -> tuple[dict, bytes]:
    _, _, _, n = wire._PREFIX.unpack_from(data)
    end = wire._PREFIX.size + n
    return json.loads(data[wire._PREFIX.size : end]), data[end + (-end % 8) :]


def _build(header: dict | bytes, arrays_bytes: bytes = b"", *, version: int = wire.VERSION, flags: int = 0) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    head = wire._PREFIX.pack(wire.MAGIC, version, flags, len(raw)) + raw
    return head + b"\0" * (-len(head) % 8) + arrays_bytes


def _edited(edit) -> bytes:
    header, rest = _split(encode({"k": 1}, {"a": np.arange(4, dtype=np.int32)}, schema="plan"))
    edit(header)
    return _build(header, rest)


def _reject(data: bytes, match: str, **kwargs) -> None:
    with pytest.raises(PayloadError, match=match):
        decode(data, **{"max_bytes": MAX, **kwargs})


def test_the_helpers_rebuild_a_valid_payload():
    meta, got = decode(_edited(lambda h: None), max_bytes=MAX, schema="plan")
    assert meta == {"k": 1} and got["a"].tolist() == [0, 1, 2, 3]


# --- each corruption, each with its own message --------------------------------------------


def test_size_is_checked_before_anything_is_parsed():
    _reject(b"\xff" * 100, "over the limit of 99", max_bytes=99)


def test_truncated_prefix():
    _reject(wire.MAGIC + b"\x01", "truncated")


def test_bad_magic():
    _reject(b"PK\x03\x04" + encode({}, {})[4:], "not a dyn-plugin payload")


def test_other_version():
    _reject(_build({"schema": "", "meta": {}, "arrays": []}, version=2), "format version 2")


def test_unknown_flags():
    _reject(_build({"schema": "", "meta": {}, "arrays": []}, flags=4), "unknown flags")


def test_header_longer_than_payload():
    data = encode({"k": "v" * 20}, {})
    _reject(data[: wire._PREFIX.size + 10], "header length .* runs past the end")


@pytest.mark.parametrize(
    "header, match",
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b'{"schema": "", "meta": {"x": NaN}, "arrays": []}', "NaN, which is not valid JSON"),
        (b"[1, 2]", "exactly the keys schema, meta, arrays"),
        (b'{"schema": "", "meta": {}}', "exactly the keys"),
        (b'{"schema": "", "meta": {}, "arrays": [], "extra": 1}', "exactly the keys"),
        (b'{"schema": 3, "meta": {}, "arrays": []}', "wrong types"),
        (b'{"schema": "", "meta": [], "arrays": []}', "wrong types"),
        (b'{"schema": "", "meta": {}, "arrays": {}}', "wrong types"),
    ],
)
def test_bad_header(header, match):
    _reject(_build(header), match)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("dtype", "object", "dtype 'object'"),
        ("dtype", "float16", "dtype 'float16'"),
        ("dtype", "<i4", "dtype '<i4'"),
        ("shape", [2, -2], "shape"),
        ("shape", "4", "shape"),
        ("shape", [4.0], "shape"),
        ("offset", -8, "offset -8"),
        ("offset", 8, "runs past the end"),
        ("offset", True, "offset True"),
        ("nbytes", 12, "does not match dtype int32 x shape"),
        ("nbytes", "16", "nbytes '16'"),
        ("name", 7, "name 7 is not a string"),
    ],
)
def test_bad_array_entry(field, value, match):
    def edit(header):
        header["arrays"][0][field] = value

    _reject(_edited(edit), match)


def test_array_entry_with_missing_key():
    _reject(_edited(lambda h: h["arrays"][0].pop("nbytes")), "exactly the keys name, dtype")


def test_shape_and_nbytes_consistent_but_beyond_the_buffer():
    def edit(header):
        header["arrays"][0].update(shape=[1000], nbytes=4000)

    _reject(_edited(edit), "runs past the end")


def test_duplicate_array_names():
    _reject(_edited(lambda h: h["arrays"].append(dict(h["arrays"][0]))), "appears twice")


def test_truncated_array_bytes():
    data = encode({}, {"a": np.arange(100, dtype=np.int64)})
    _reject(data[:-8], "runs past the end")


def test_schema_mismatch():
    data = encode({}, {}, schema="plan/v1")
    _reject(data, "schema is 'plan/v1', expected 'other'", schema="other")
    assert decode(data, max_bytes=MAX, schema="plan/v1") == ({}, {})


def test_forged_payload_with_another_secret():
    _reject(encode({"step": 3}, {}, secret=b"attacker-secret-xxxxxx"), "HMAC does not match", secret=SECRET)


def test_altered_meta_after_signing():
    data = encode({"step": 3}, {"a": np.zeros(4)}, secret=SECRET)
    _reject(data.replace(b'"step":3', b'"step":4'), "HMAC does not match", secret=SECRET)


def test_signed_payload_without_a_secret():
    _reject(encode({}, {}, secret=SECRET), "signed but no secret")


def test_unsigned_payload_when_a_secret_is_required():
    _reject(encode({}, {}), "not signed but a secret was given", secret=SECRET)


def test_stripping_the_signature_does_not_help():
    signed = encode({"step": 3}, {}, secret=SECRET)
    stripped = signed[:6] + b"\0\0" + signed[8 : -wire.TAG_BYTES]
    _reject(stripped, "not signed but a secret was given", secret=SECRET)


def test_signed_payload_truncated_into_its_tag():
    _reject(_build(b"", flags=wire.FLAG_SIGNED)[:20], "too short to hold its HMAC tag", secret=SECRET)


# --- encode refuses what decode would refuse ------------------------------------------------


@pytest.mark.parametrize(
    "meta, arrs, match",
    [
        ({}, {"a": np.array([object()])}, "dtype object"),
        ({}, {"a": np.zeros(2, dtype=np.float16)}, "dtype float16"),
        ({}, {"a": [1, 2]}, "not a numpy array"),
        ({}, {1: np.zeros(2)}, "names must be strings"),
        ({"x": math.nan}, {}, "not strict JSON"),
        ({"x": {1, 2}}, {}, "not strict JSON"),
        ({"x": np.int64(3)}, {}, "not strict JSON"),
        ([1], {}, "meta must be a dict"),
    ],
)
def test_encode_refuses(meta, arrs, match):
    with pytest.raises(PayloadError, match=match):
        encode(meta, arrs)
