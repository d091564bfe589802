"""The checks a server runs on a request before it uses it: its body (decoded once into its
declared type, :mod:`hetps.cluster.bodies`), the slice it names, a push's payload. Each raises :class:`~hetps.kvstore.slices.BadRequest` with
a text that names the key and what is wrong; the server answers it and goes on serving."""

from __future__ import annotations

from typing import Any

import numpy as np
from msgspec import ValidationError, convert

from hetps.cluster import bodies
from hetps.cluster.bodies import Chunk, Init, Push
from hetps.kvstore.compression import TwoBitCompressor
from hetps.kvstore.slices import BadRequest, Slice, short
from hetps.transport.codec import Message, dtype_str


def body(msg: Message, kind: type[Chunk]) -> Any:
    """``msg``'s body as its declared type (:mod:`hetps.cluster.bodies`), checked once: a
    message handled again (a push kept for the next round) keeps what it was decoded to.
    (:func:`hetps.cluster.bodies.decode`, one call less: this runs for every request.)"""
    typed = msg.typed
    if type(typed) is kind:
        return typed
    try:
        typed = msg.typed = convert(msg.body, kind)
    except ValidationError as exc:
        raise BadRequest(bodies.explain(msg.cmd, msg.body, kind, str(exc))) from None
    return typed


def find_slice(slices: dict, msg: Message, b: Chunk) -> Slice:
    """The slice a request names, which must hold its range (and match its shape and dtype,
    when the request states them)."""
    key, part, off, n = b.key, b.part, b.offset, b.count
    sl = slices.get((key, part))
    if sl is None:
        if not any(k == key for k, _ in slices):
            raise BadRequest(
                f"key {key!r} was never initialised: call kv.init({key!r}, value) first"
            )
        raise BadRequest(f"key {key!r} has no part {part} on this server")
    shape, dtype = b.shape, b.dtype
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


def payload_fits(msg: Message, sl: Slice, b: Push) -> None:
    """Check a push's payload (count, dtype, size) against its range of ``sl`` without
    decoding it: a push is never kept unless it fits."""
    if len(msg.arrays) != 1:
        raise BadRequest(f"{msg.cmd} of key {sl.key!r}: expected one array, got {len(msg.arrays)}")
    data, n = msg.arrays[0], b.count
    if b.threshold is not None:
        ok = data.dtype == np.uint32 and data.size == (n + 15) // 16
    else:
        ok = data.dtype == sl.value.dtype and data.size == n
    if not ok:
        raise BadRequest(
            f"{msg.cmd} of key {sl.key!r}: got {data.size} values of {data.dtype} for "
            f"{n} values of {sl.value.dtype} (key shape {sl.shape})"
        )


def push_data(msg: Message, sl: Slice, b: Push | Init, packed: bool = False) -> np.ndarray:
    """The push's (or init's) values, checked; a 2-bit push decoded (``packed``: its checked
    words, which :func:`~hetps.kvstore.slices.put` decodes straight into the merge buffer)."""
    if len(msg.arrays) != 1:
        raise BadRequest(f"{msg.cmd} of key {sl.key!r}: expected one array, got {len(msg.arrays)}")
    data, n = msg.arrays[0].reshape(-1), b.count
    threshold = getattr(b, "threshold", None)
    if threshold is not None:
        words = (n + 15) // 16
        if data.dtype != np.uint32 or data.size != words:
            raise BadRequest(
                f"push of key {sl.key!r}: 2-bit payload must be {words} uint32 words for "
                f"{n} values, got {data.size} {data.dtype}"
            )
        if packed:
            return data
        return TwoBitCompressor(threshold).decompress(data, n, sl.value.dtype)
    if data.dtype != sl.value.dtype or data.size != n:
        raise BadRequest(
            f"{msg.cmd} of key {sl.key!r}: got {data.size} values of {data.dtype}, expected "
            f"{n} of {sl.value.dtype} (key shape {sl.shape})"
        )
    return data
