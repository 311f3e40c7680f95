"""Plan payloads on the wire: a JSON header plus raw numpy arrays, never pickle.

Layout (all integers little-endian)::

    magic b"DYNP" | version u16 | flags u16 | header_len u32 | header JSON (utf-8)
    | zero padding to a multiple of 8 | array bytes | HMAC-SHA256 tag (32 bytes, if signed)

The header is ``{"schema": str, "meta": {...}, "arrays": [{"name", "dtype", "shape",
"offset", "nbytes"}, ...]}``; offsets count from the start of the array bytes and each
array starts on an 8-byte boundary, so decoded arrays are aligned zero-copy views.

Pickle is out because a payload comes from another process over a network: decoding
must not be able to run code. The tag covers every byte before it, so a signed payload
cannot be altered or have its signed flag cleared without the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
from typing import Any

import numpy as np

from .base import PayloadError

MAGIC = b"DYNP"
VERSION = 1
FLAG_SIGNED = 1
TAG_BYTES = hashlib.sha256().digest_size

_PREFIX = struct.Struct("<4sHHI")
_ALIGN = 8
DTYPES = frozenset(
    ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32", "float64", "bool"]
)


def _pad(n: int) -> int:
    return -n % _ALIGN


def _tag(secret: bytes, data: bytes | memoryview) -> bytes:
    return hmac.new(secret, data, hashlib.sha256).digest()


def _reject_constant(name: str) -> Any:
    raise PayloadError(f"payload header contains {name}, which is not valid JSON")


def encode(
    meta: dict,
    arrays: dict[str, np.ndarray],
    *,
    secret: bytes | None = None,
    schema: str = "",
) -> bytes:
    """Serialize ``meta`` (strict JSON) and ``arrays`` (whitelisted dtypes) into one payload.

    ``schema`` names what the payload holds so a reader can refuse the wrong kind. With a
    ``secret`` the payload is HMAC-signed; a :class:`~dyn_plugin.store.base.PlanStore`
    opened with a secret already signs what it stores, so this is for payloads that travel
    some other way.
    """
    if not isinstance(meta, dict):
        raise PayloadError(f"meta must be a dict, got {type(meta).__name__}")
    table, chunks, offset = [], [], 0
    for name, array in arrays.items():
        if not isinstance(name, str):
            raise PayloadError(f"array names must be strings, got {name!r}")
        if not isinstance(array, np.ndarray):
            raise PayloadError(f"array {name!r} is a {type(array).__name__}, not a numpy array")
        if array.dtype.name not in DTYPES:
            raise PayloadError(f"array {name!r} has dtype {array.dtype}; allowed: {', '.join(sorted(DTYPES))}")
        raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
        table.append(
            {"name": name, "dtype": array.dtype.name, "shape": list(array.shape), "offset": offset, "nbytes": len(raw)}
        )
        chunks += [raw, b"\0" * _pad(len(raw))]
        offset += len(raw) + _pad(len(raw))
    try:
        header = json.dumps(
            {"schema": schema, "meta": meta, "arrays": table}, allow_nan=False, separators=(",", ":")
        ).encode()
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"meta is not strict JSON ({exc}); convert numpy scalars, NaN and inf first") from None
    flags = FLAG_SIGNED if secret is not None else 0
    prefix = _PREFIX.pack(MAGIC, VERSION, flags, len(header))
    body = b"".join([prefix, header, b"\0" * _pad(len(prefix) + len(header)), *chunks])
    return body + _tag(secret, body) if secret is not None else body


def decode(
    data: bytes,
    *,
    max_bytes: int,
    secret: bytes | None = None,
    schema: str | None = None,
) -> tuple[dict, dict[str, np.ndarray]]:
    """Check and parse a payload from :func:`encode`; returns ``(meta, arrays)``.

    The arrays are read-only views into ``data`` (no copy). Every problem is a
    :class:`PayloadError`; nothing in ``data`` is trusted until it has been checked,
    and with a ``secret`` nothing is parsed until the tag has been verified.
    """
    if len(data) > max_bytes:
        raise PayloadError(
            f"payload is {len(data)} bytes, over the limit of {max_bytes}; raise store.max_payload_mb if plans are this big"
        )
    if len(data) < _PREFIX.size:
        raise PayloadError(f"payload is {len(data)} bytes, shorter than the {_PREFIX.size}-byte prefix: truncated")
    magic, version, flags, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise PayloadError(f"not a dyn-plugin payload: starts with {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise PayloadError(
            f"payload format version {version}, this dyn-plugin reads {VERSION}: run the same dyn-plugin version on every rank and planner"
        )
    if flags & ~FLAG_SIGNED:
        raise PayloadError(f"payload has unknown flags {flags:#x}")
    body = memoryview(data)
    if flags & FLAG_SIGNED:
        if secret is None:
            raise PayloadError(
                "payload is signed but no secret was given to check it; give the reader the writer's secret"
            )
        if len(data) < _PREFIX.size + TAG_BYTES:
            raise PayloadError("signed payload is too short to hold its HMAC tag: truncated")
        body = body[:-TAG_BYTES]
        if not hmac.compare_digest(_tag(secret, body), bytes(data[-TAG_BYTES:])):
            raise PayloadError("payload HMAC does not match: altered, forged, or signed with a different secret")
    elif secret is not None:
        raise PayloadError("payload is not signed but a secret was given: refusing an unauthenticated payload")

    header_end = _PREFIX.size + header_len
    if header_end > len(body):
        raise PayloadError(
            f"header length {header_len} runs past the end of the {len(body)}-byte payload: truncated or corrupt"
        )
    try:
        header = json.loads(bytes(body[_PREFIX.size : header_end]), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PayloadError(f"payload header is not valid JSON: {exc}") from None
    if not isinstance(header, dict) or set(header) != {"schema", "meta", "arrays"}:
        raise PayloadError("payload header must be an object with exactly the keys schema, meta, arrays")
    if (
        not isinstance(header["schema"], str)
        or not isinstance(header["meta"], dict)
        or not isinstance(header["arrays"], list)
    ):
        raise PayloadError("payload header has wrong types: schema must be a string, meta an object, arrays a list")
    if schema is not None and header["schema"] != schema:
        raise PayloadError(f"payload schema is {header['schema']!r}, expected {schema!r}")

    data_start = header_end + _pad(header_end)
    if data_start > len(body):
        raise PayloadError("payload ends inside the header padding: truncated")
    arrays = {}
    for entry in header["arrays"]:
        name, array = _array(entry, body, data_start)
        if name in arrays:
            raise PayloadError(f"array {name!r} appears twice in the payload header")
        arrays[name] = array
    return header["meta"], arrays


def _array(entry: Any, body: memoryview, data_start: int) -> tuple[str, np.ndarray]:
    if not isinstance(entry, dict) or set(entry) != {"name", "dtype", "shape", "offset", "nbytes"}:
        raise PayloadError(f"array entry {entry!r} must have exactly the keys name, dtype, shape, offset, nbytes")
    name, dtype, shape, offset, nbytes = (entry[k] for k in ("name", "dtype", "shape", "offset", "nbytes"))
    if not isinstance(name, str):
        raise PayloadError(f"array name {name!r} is not a string")
    if dtype not in DTYPES:
        raise PayloadError(f"array {name!r} has dtype {dtype!r}; allowed: {', '.join(sorted(DTYPES))}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise PayloadError(f"array {name!r} has shape {shape!r}; expected a list of non-negative integers")
    for field, value in (("offset", offset), ("nbytes", nbytes)):
        if type(value) is not int or value < 0:
            raise PayloadError(f"array {name!r} has {field} {value!r}; expected a non-negative integer")
    dt = np.dtype(dtype).newbyteorder("<")
    if nbytes != math.prod(shape) * dt.itemsize:
        raise PayloadError(f"array {name!r}: nbytes {nbytes} does not match dtype {dtype} x shape {shape}")
    start = data_start + offset
    if start + nbytes > len(body):
        raise PayloadError(f"array {name!r} (offset {offset}, {nbytes} bytes) runs past the end of the payload")
    array = np.frombuffer(body, dtype=dt, count=math.prod(shape), offset=start).reshape(shape)
    return name, array
