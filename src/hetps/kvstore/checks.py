"""The checks a server runs on a request before it uses it: fields, a key's range, the
slice it names, a push's payload. Each raises :class:`~hetps.kvstore.slices.BadRequest` with
a text that names the key and what is wrong; the server answers it and goes on serving."""

from __future__ import annotations

from typing import Any

import numpy as np

from hetps.kvstore.compression import TwoBitCompressor
from hetps.kvstore.slices import BadRequest, Slice, short
from hetps.transport.codec import Message, dtype_str


def field(msg: Message, name: str, kind: type | tuple[type, ...]) -> Any:
    """``msg.body[name]``, which must be a ``kind`` (never a bool)."""
    value = msg.body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise BadRequest(f"{msg.cmd}: field {name!r} missing or not {kind}")
    return value


def tag(msg: Message) -> int:
    """A measured message's tag (its request id on the worker)."""
    value = msg.body.get("tag")
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"{msg.cmd}: field 'tag' must be an integer")
    return value


def key_range(msg: Message) -> tuple[Any, int, int, int]:
    """A chunk request's key, part, offset and length."""
    key = msg.body.get("k")
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise BadRequest(f"{msg.cmd}: key {short(key)} must be an int or a str")
    if isinstance(key, str) and len(key) > 1024:
        raise BadRequest(f"{msg.cmd}: a key of {len(key)} characters is longer than 1024")
    part = field(msg, "part", int)
    off = field(msg, "off", int)
    n = field(msg, "n", int)
    if off < 0 or n < 0:
        raise BadRequest(f"{msg.cmd} of key {key!r}: negative offset or length")
    return key, part, off, n


def find_slice(slices: dict, msg: Message, key: Any, part: int, off: int, n: int) -> Slice:
    """The slice a request names, which must hold its range (and match its shape and dtype,
    when the request states them)."""
    sl = slices.get((key, part))
    if sl is None:
        if not any(k == key for k, _ in slices):
            raise BadRequest(
                f"key {key!r} was never initialised: call kv.init({key!r}, value) first"
            )
        raise BadRequest(f"key {key!r} has no part {part} on this server")
    shape = msg.body.get("shape")
    dtype = msg.body.get("dtype")
    if shape is not None and not isinstance(shape, list):
        raise BadRequest(f"{msg.cmd} of key {key!r}: field 'shape' must be a list")
    if dtype is not None and not isinstance(dtype, str):
        raise BadRequest(f"{msg.cmd} of key {key!r}: field 'dtype' must be a string")
    if (
        shape is not None
        and tuple(shape) != sl.shape
        or (dtype is not None and dtype != dtype_str(sl.value.dtype))
    ):
        raise BadRequest(
            f"{msg.cmd} of key {key!r}: shape {short(shape)} dtype {short(dtype)} does "
            f"not match the key's shape {sl.shape} dtype {sl.value.dtype.name}"
        )
    if off + n > sl.value.size:
        raise BadRequest(
            f"{msg.cmd} of key {key!r}: range [{off}, {off + n}) is outside part {part} "
            f"of {sl.value.size} elements (key shape {sl.shape})"
        )
    return sl


def payload_fits(msg: Message, sl: Slice, n: int) -> None:
    """Check a push's payload (count, dtype, size) against its range of ``sl`` without
    decoding it: a push is never kept unless it fits."""
    if len(msg.arrays) != 1:
        raise BadRequest(f"{msg.cmd} of key {sl.key!r}: expected one array, got {len(msg.arrays)}")
    data = msg.arrays[0]
    if msg.body.get("comp") is not None:
        ok = data.dtype == np.uint32 and data.size == (n + 15) // 16
    else:
        ok = data.dtype == sl.value.dtype and data.size == n
    if not ok:
        raise BadRequest(
            f"{msg.cmd} of key {sl.key!r}: got {data.size} values of {data.dtype} for "
            f"{n} values of {sl.value.dtype} (key shape {sl.shape})"
        )


def push_data(msg: Message, sl: Slice, n: int, packed: bool = False) -> np.ndarray:
    """The push's values, checked; a 2-bit push decoded (``packed``: its checked words,
    which :func:`~hetps.kvstore.slices.put` decodes straight into the merge buffer)."""
    if len(msg.arrays) != 1:
        raise BadRequest(f"{msg.cmd} of key {sl.key!r}: expected one array, got {len(msg.arrays)}")
    data = msg.arrays[0].reshape(-1)
    threshold = msg.body.get("comp")
    if threshold is not None:
        if (
            not isinstance(threshold, (int, float))
            or isinstance(threshold, bool)
            or not 0 < threshold < float("inf")
        ):
            raise BadRequest(f"push of key {sl.key!r}: bad compression threshold {threshold!r}")
        words = (n + 15) // 16
        if data.dtype != np.uint32 or data.size != words:
            raise BadRequest(
                f"push of key {sl.key!r}: 2-bit payload must be {words} uint32 words for "
                f"{n} values, got {data.size} {data.dtype}"
            )
        if packed:
            return data
        return TwoBitCompressor(float(threshold)).decompress(data, n, sl.value.dtype)
    if data.dtype != sl.value.dtype or data.size != n:
        raise BadRequest(
            f"{msg.cmd} of key {sl.key!r}: got {data.size} values of {data.dtype}, expected "
            f"{n} of {sl.value.dtype} (key shape {sl.shape})"
        )
    return data
