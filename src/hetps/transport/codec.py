"""Message codec: a msgpack header frame followed by raw array frames.

Wire layout of one ZeroMQ multipart message (after the ROUTER identity frame)::

    frame 0   msgpack map: {"v": version, "c": command, "r": request id,
                            "p": is_reply, "o": priority, "t": send time (s, float),
                            "b": body map, "a": [[dtype, [dim, ...]], ...]}
    frame 1.. raw little-endian C-order array bytes: each entry of "a" in
              ceil(bytes / FRAME_MAX) frames (at least one), in order; an array sent
              through a same-host shared-memory ring is one empty frame instead, and the
              header's "m" ([ring name, [counter or -1 per array]]) says where it is

The header carries no sender: who sent a message is the connection it came on (the van maps
the ZeroMQ routing id to a node id, see docs/SECURITY.md). A field ``"s"`` from an older peer
is ignored. No frame is larger than :data:`FRAME_MAX`, so a receiver can refuse any bigger
frame at the socket (``ZMQ_MAXMSGSIZE``) before ZeroMQ allocates memory for it; an array
bigger than that travels in several frames and is joined (one copy) on arrival.

Arrays are sent without copies (``copy=False``) and decoded with ``np.frombuffer`` over the
received frame, so a 256 MB push is never duplicated in user space (a ring-borne array is
copied out of the ring, into the place its request named where there is one, or lent). :func:`decode` checks every
header field and every frame size against the header before anything is used, and raises
:class:`BadMessage` (never anything else) on malformed input.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgpack
import msgspec
import numpy as np
from msgspec import Meta

VERSION = 1

#: dtypes allowed on the wire; anything else is refused.
WIRE_DTYPES = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "uint8": np.dtype("u1"),
    "uint32": np.dtype("<u4"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
}
_NAME_OF = {dt: name for name, dt in WIRE_DTYPES.items()}
MAX_DIMS = 32
MAX_HEADER_BYTES = 1 << 20
#: the largest frame on the wire: bigger arrays are split (a wire constant: every peer agrees)
FRAME_MAX = 16 << 20


class BadMessage(ValueError):
    """A received message failed validation; the text says which field and why."""


class NotYet(Exception):
    """A message whose arrays come on a bulk channel (transport/bulk_in.py) and are not all
    here yet: the receiver keeps its frames and decodes it again once they are."""

    def __init__(self, ring: Any) -> None:
        super().__init__(f"waiting for frames of {getattr(ring, 'name', ring)}")
        self.ring = ring


@dataclass
class Message:
    """One decoded message: a command, routing metadata, a small body and array payloads."""

    cmd: str
    #: set by the receiving van from the connection (never from the wire): the sending node's
    #: id, or 0 when the connection belongs to no known node
    sender: int = 0
    req: int = 0
    reply: bool = False
    priority: int = 0
    body: dict[str, Any] = field(default_factory=dict)
    arrays: list[np.ndarray] = field(default_factory=list)
    sent_at: float = 0.0
    nbytes: int = 0
    # set by the receiver (never on the wire): this message was already waiting when the
    # receive thread came to look, so the time it was taken is later than its arrival
    backlogged: bool = False
    #: set by the receiver: the ZeroMQ routing id of the connection the message came on
    origin: bytes = b""
    #: set by the receiver (never on the wire): the shared-memory ring some of ``arrays`` are
    #: read-only views of (``decode``'s ``borrow``); the ring keeps them until the receiver
    #: releases the message (:meth:`hetps.transport.van.Van.release`), None when it owns them
    lease: Any = field(default=None, repr=False, compare=False)
    #: set by the sender (never on the wire): ``arrays`` are views of the caller's memory,
    #: which may change once the send returns, so the van copies them as it sends (into a
    #: shared-memory ring, or ZeroMQ's own buffer) and never sends them zero-copy
    borrowed: bool = field(default=False, repr=False, compare=False)
    #: set by the receiver (never on the wire): ``body`` as its command's declared type, by
    #: the dispatch that took it (hetps.cluster.commands.decode); a message handled again
    #: (a push kept for a later round) keeps it and is not decoded again
    typed: Any = field(default=None, repr=False, compare=False)
    #: set by the sender (never on the wire): the receiver times this message's arrival from
    #: a forecast sent just before it (network-aware balancing); when its arrays take a bulk
    #: channel, a mark frame leads them there, so the clock starts where their bytes do
    timed: bool = field(default=False, repr=False, compare=False)
    #: set by the receiver (never on the wire): when a timed message's bulk mark arrived,
    #: whether the receive thread was behind then (that stamp may be late), and when the
    #: message was whole, both read by the receive thread; None without a mark
    mark: tuple[float, bool, float] | None = field(default=None, repr=False, compare=False)

    @property
    def error(self) -> str | None:
        """The error text of an error reply, else None."""
        err = self.body.get("error")
        return err if isinstance(err, str) else None


_DTYPE_STR: dict[np.dtype, str] = {}


def dtype_str(dtype: np.dtype) -> str:
    """``dtype.name``, looked up: numpy works it out anew on every call (about 2 us, twice
    per small request: the worker's request body, the server's check of it)."""
    name = _DTYPE_STR.get(dtype)
    if name is None:
        name = _DTYPE_STR[dtype] = dtype.name
    return name


def dtype_name(dtype: np.dtype) -> str:
    """Wire name of ``dtype``; raises ValueError for a dtype hetps does not carry."""
    dt = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
    name = _NAME_OF.get(dt)
    if name is None:
        raise ValueError(
            f"dtype {np.dtype(dtype)} cannot be sent: use one of {', '.join(sorted(WIRE_DTYPES))}"
        )
    return name


def encode(msg: Message, ring: Any = None, min_ring_bytes: int = 0) -> list[Any]:
    """Return the frames of ``msg`` (header bytes, then one buffer per array, not copied).

    With a ``ring`` (a :class:`~hetps.transport.shm.OutRing` the receiver has opened), arrays
    of at least ``min_ring_bytes`` are copied into it and travel as an empty frame plus their
    ring counter in the header's ``"m"`` field: ``[ring name, [counter or -1 per array]]``.
    A bulk channel (:class:`~hetps.transport.bulk.OutChannel`) also takes a ``timed`` message's
    mark, an empty frame ahead of its arrays whose counter is the field's third item.
    """
    specs = []
    frames: list[Any] = [b""]
    nbytes = 0
    placed: list[int] = []
    in_ring = False
    mark = None
    if (
        msg.timed
        and ring is not None
        and hasattr(ring, "put_mark")
        and any(a.nbytes >= min_ring_bytes and a.nbytes for a in msg.arrays)
    ):
        mark = ring.put_mark()
    for arr in msg.arrays:
        if isinstance(arr, Rows):  # gathered straight into the ring, else into one array
            big = arr.nbytes >= min_ring_bytes and arr.nbytes
            got = ring.slot(arr.nbytes) if big and _slots(ring) else None
            if got is not None:
                arr.gather(got[1])
                specs.append([_NAME_OF[arr.dtype], [arr.size]])
                placed.append(got[0])
                in_ring = True
                frames.append(b"")
                nbytes += arr.nbytes
                continue
            arr = arr.gather()
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        name = _NAME_OF.get(arr.dtype)
        specs.append([name if name is not None else dtype_name(arr.dtype), list(arr.shape)])
        size = arr.nbytes
        raw = arr.reshape(-1).view(np.uint8) if size else b""
        pos = None
        if ring is not None and size >= min_ring_bytes and size:
            pos = ring.put(raw)
        if pos is not None:
            placed.append(pos)
            in_ring = True
            frames.append(b"")
        else:
            placed.append(-1)
            if size > FRAME_MAX:
                frames += [raw[i : i + FRAME_MAX] for i in range(0, size, FRAME_MAX)]
            else:
                frames.append(raw)
        nbytes += size
    header = {
        "v": VERSION,
        "c": msg.cmd,
        "r": msg.req,
        "p": msg.reply,
        "o": msg.priority,
        "t": time.time(),
        "b": msg.body,
        "a": specs,
    }
    if in_ring:
        header["m"] = [ring.name, placed] if mark is None else [ring.name, placed, mark]
    frames[0] = _packer().pack(header)
    msg.nbytes = nbytes + len(frames[0])
    return frames


def _slots(ring: Any) -> bool:
    return ring is not None and hasattr(ring, "slot")


class Rows:
    """Rows of a 2-D table to send as one flat array, gathered only as the message leaves:
    straight into a shared-memory ring's slot (one copy), or into one array for the wire.
    ``done(self)`` runs once they are gathered: the table may change from then on."""

    __slots__ = ("table", "rows", "dtype", "size", "shape", "nbytes", "done", "_got")

    def __init__(self, table: np.ndarray, rows: np.ndarray, done: Any = None) -> None:
        self.table, self.rows, self.done = table, rows, done
        self.dtype = table.dtype
        self.size = rows.size * table.shape[1]
        self.shape = (self.size,)
        self.nbytes = self.size * table.itemsize
        self._got: np.ndarray | None = None

    def gather(self, out: np.ndarray | None = None) -> np.ndarray:
        """The rows, flat: into ``out`` (``nbytes`` uint8) when given, else a new array."""
        got = self._got
        if out is None and got is not None:
            return got
        cols = self.table.shape[1]
        dest = None if out is None else out.view(self.dtype).reshape(self.rows.size, cols)
        if got is not None:
            dest[...] = got.reshape(self.rows.size, cols)  # type: ignore[index]
        else:  # ('clip': the rows are checked; 'raise' would gather into a buffer first)
            dest = np.take(self.table, self.rows, axis=0, out=dest, mode="clip")
            if out is None:
                self._got = dest.reshape(-1)
            if self.done is not None:
                self.done(self)
        return dest.reshape(-1)

    def reshape(self, *shape: Any) -> np.ndarray:
        """The rows gathered (as an array of their own), reshaped."""
        return self.gather().reshape(*shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        got = self.gather()
        return got if dtype is None else got.astype(dtype)


_local = threading.local()


def _packer() -> msgpack.Packer:
    """This thread's msgpack packer (making one per message cost a microsecond each; a
    packer is not shared between threads). Its output is ``packb(..., use_bin_type=True)``'s."""
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return packer


def _buffer(frame: Any) -> memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview, np.ndarray)):
        return memoryview(frame)
    return frame.buffer  # zmq.Frame


def decode(
    frames: list[Any],
    max_bytes: int,
    rings: Any = None,
    landing_of: Any = None,
    origin: Any = None,
    borrow: Any = (),
    quick: bool = True,
) -> Message:
    """Decode and validate ``frames`` (header first). Raises :class:`BadMessage` on bad input.

    Every bound is checked on the header alone before any array is built: the header's size,
    each array's dtype and shape, the message's total against ``max_bytes`` and the number of
    frames the arrays need. Arrays over :data:`FRAME_MAX` come in several frames and are
    joined (one copy); all others are views over their frame (no copy).

    ``rings`` maps ring names to :class:`~hetps.transport.shm.InRing` for arrays that came
    through shared memory (header field ``"m"``); their bytes are copied out of the ring, and
    what was copied out is released to the sender even when the message then fails validation.
    A ring may carry only the arrays of the connection that offered it: its ``owner`` must be
    ``origin`` (the routing id the message came with). ``landing_of(cmd, req, body, count)``
    may name where a reply's arrays go (``{array index: flat array of its dtype and size}``,
    or None, or an object whose ``land(view)`` copies the array where it belongs and
    returns what the message holds instead): a ring-borne array is then copied there, not
    into a new array.

    A request whose command is in ``borrow`` gets its ring-borne arrays as read-only views of
    the ring, not copies: nothing is released to the sender then, and the message's ``lease``
    names the ring; the caller commits it once nothing reads the views any more. ``quick``
    False: every message takes the full path, checked field by field (the tests compare).
    """
    if quick:  # the common message, quickly (_decode_plain); anything else checked below
        msg = _decode_plain(frames, max_bytes, rings, landing_of, origin, borrow)
        if msg is not None:
            return msg
    if not frames:
        raise BadMessage("empty message")
    head = _buffer(frames[0])
    if len(head) > MAX_HEADER_BYTES:
        raise BadMessage(f"header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several exception types
        raise BadMessage(f"header is not msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise BadMessage("header is not a map")
    if header.get("v") != VERSION:
        raise BadMessage(f"unsupported version {header.get('v')!r} (this node speaks {VERSION})")
    cmd = header.get("c")
    req = header.get("r")
    reply = header.get("p")
    prio = header.get("o", 0)
    body = header.get("b", {})
    specs = header.get("a", [])
    sent_at = header.get("t", 0.0)
    if not isinstance(cmd, str) or not cmd:
        raise BadMessage("field 'c' (command) must be a non-empty string")
    if len(cmd) > 64 or not (cmd.isascii() and cmd.isprintable()):
        raise BadMessage("field 'c' (command) must be at most 64 printable ASCII characters")
    for name, value in (("r", req), ("o", prio)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise BadMessage(f"field {name!r} must be an integer, got {type(value).__name__}")
    if not isinstance(reply, bool):
        raise BadMessage("field 'p' (is reply) must be a boolean")
    if not isinstance(body, dict):
        raise BadMessage("field 'b' (body) must be a map")
    if not isinstance(sent_at, (int, float)) or isinstance(sent_at, bool):
        raise BadMessage("field 't' (send time) must be a number")
    if not isinstance(specs, list):
        raise BadMessage("field 'a' (arrays) must be a list")
    placed, mark = _ring_positions(header.get("m"), len(specs), rings, origin)
    # every bound from the header alone, before any array is made
    layout = [_spec(i, spec) for i, spec in enumerate(specs)]
    total = len(head) + sum(expected for _, _, _, expected in layout)
    if total > max_bytes:
        raise BadMessage(f"message of {total} bytes exceeds the size bound of {max_bytes} bytes")
    counts = [
        1 if (placed is not None and placed[i] >= 0) else _frames_for(expected)
        for i, (_, _, _, expected) in enumerate(layout)
    ]
    if sum(counts) != len(frames) - 1:
        raise BadMessage(
            f"header announces {len(specs)} arrays in {sum(counts)} frames but "
            f"{len(frames) - 1} frames came"
        )
    ring = rings[header["m"][0]] if placed else None
    arrays: list[np.ndarray] = []
    targets = None
    lent = ring is not None and getattr(ring, "lends", True) and reply is False and cmd in borrow
    ok = waits = False
    stamp = None
    try:
        if placed and reply is True and landing_of is not None:
            try:
                targets = landing_of(cmd, req, body, len(layout))
            except Exception:  # noqa: BLE001 - no place: the arrays are copied out as usual
                targets = None
        at = 1
        for i, item in enumerate(layout):
            parts = frames[at : at + counts[i]]
            at += counts[i]
            target = targets.get(i) if targets else None
            arrays.append(_decode_array(i, item, parts, placed, ring, target, lent))
        if mark is not None:  # (it came ahead of the arrays on their connection)
            stamp = ring.stamp(mark)
        ok = True
    except NotYet:
        waits = True  # (decoded again once its frames are here: nothing is used up)
        raise
    finally:
        if ring is not None and not waits and not (ok and lent):  # what was taken out may
            ring.commit()  # be overwritten
    return Message(
        cmd=cmd,
        req=req,
        reply=reply,
        priority=prio,
        body=body,
        arrays=arrays,
        sent_at=float(sent_at),
        nbytes=total,
        lease=ring if lent else None,
        mark=stamp,
    )


class Header(msgspec.Struct):
    """The header as the common message's decode reads it: msgspec decodes the msgpack map
    into these types in C (an int is never a bool, a field of the wrong type fails), faster
    than msgpack's decode and a check of each field in Python (benchmarks/typed_messages.py).
    Fields it does not name are ignored, as ``"s"`` from an older peer."""

    v: int
    c: str
    r: int
    p: bool
    o: int = 0
    t: float = 0.0
    b: dict[str, Any] = {}
    a: list[tuple[str, Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_DIMS)]]] = []
    m: Any = None


_HEADER = msgspec.msgpack.Decoder(Header)


def _decode_plain(
    frames: list[Any],
    max_bytes: int,
    rings: Any = None,
    landing_of: Any = None,
    origin: Any = None,
    borrow: Any = (),
) -> Message | None:
    """The common message, quickly: the same checks as :func:`decode`'s full path, written for
    speed (the header's types checked by msgspec, :class:`Header`), for a message whose
    arrays are non-empty, each in one frame or in a shared-memory ring (``rings``,
    ``landing_of``, ``origin`` and ``borrow`` as there). None for anything else, valid or not:
    the full decode then takes it (and says what is wrong with it). Every check is made on
    the header alone before an array is made, as there."""
    if not frames:
        return None
    head = _buffer(frames[0])
    size = len(head)
    if size > MAX_HEADER_BYTES:
        return None
    try:
        header = _HEADER.decode(head)
    except Exception:  # noqa: BLE001 - the full decode says what is wrong
        return None
    cmd = header.c
    specs = header.a
    if (
        header.v != VERSION
        or not cmd
        or len(cmd) > 64
        or not (cmd.isascii() and cmd.isprintable())
        or len(specs) != len(frames) - 1
    ):
        return None
    ring = placed = None
    if header.m is not None:  # (a ring's arrays, never a bulk channel's: they may wait)
        try:
            placed, mark = _ring_positions(header.m, len(specs), rings, origin)
        except BadMessage:
            return None
        ring = rings[header.m[0]] if placed is not None else None
        if ring is None or mark is not None or not getattr(ring, "lends", True):
            return None
    layout = []
    for i, (dname, shape) in enumerate(specs):
        dt = WIRE_DTYPES.get(dname)
        if dt is None:
            return None
        count = 1
        for d in shape:
            count *= d
        expected = count * dt.itemsize
        if not count or (expected > FRAME_MAX and (placed is None or placed[i] < 0)):
            return None
        size += expected
        layout.append((dt, shape, count, expected))
    if size > max_bytes:
        return None
    arrays = []
    if ring is None:
        for i, (dt, shape, _, expected) in enumerate(layout):
            buf = _buffer(frames[i + 1])
            if len(buf) != expected:
                return None
            arr = np.frombuffer(buf, dtype=dt)
            arrays.append(arr if len(shape) == 1 else arr.reshape(shape))
    else:  # as the full path: a reply's arrays may land in place, a request's be lent
        reply = header.p
        lent = not reply and cmd in borrow
        targets = None
        if reply and landing_of is not None:
            try:
                targets = landing_of(cmd, header.r, header.b, len(layout))
            except Exception:  # noqa: BLE001 - no place: the arrays are copied out as usual
                targets = None
        ok = False
        try:
            for i, item in enumerate(layout):
                target = targets.get(i) if targets else None
                arrays.append(
                    _decode_array(i, item, frames[i + 1 : i + 2], placed, ring, target, lent)
                )
            ok = True
        finally:
            if not (ok and lent):  # what was taken out may be overwritten
                ring.commit()
    return Message(
        cmd=cmd,
        req=header.r,
        reply=header.p,
        priority=header.o,
        body=header.b,
        arrays=arrays,
        sent_at=header.t,
        nbytes=size,
        lease=ring if ring is not None and lent else None,
    )


def _frames_for(nbytes: int) -> int:
    """Frames an inline array of ``nbytes`` takes on the wire."""
    return max(1, -(-nbytes // FRAME_MAX))


def _ring_positions(
    field_m: Any, n: int, rings: Any, origin: Any
) -> tuple[list[int] | None, int | None]:
    """Validate header field ``"m"``; the per-array ring counters (-1: inline), or None, and
    the counter of a bulk channel's mark (None: none)."""
    if field_m is None:
        return None, None
    if not (isinstance(field_m, list) and len(field_m) in (2, 3) and isinstance(field_m[1], list)):
        raise BadMessage(
            "field 'm' (shared-memory frames) must be [ring name, [counter, ...](, mark)]"
        )
    name, placed = field_m[:2]
    mark = field_m[2] if len(field_m) == 3 else None
    if len(placed) != n or not all(
        isinstance(p, int) and not isinstance(p, bool) and p >= -1 for p in placed
    ):
        raise BadMessage(f"field 'm' must hold one counter (or -1) per array, {n} in all")
    if rings is None or not isinstance(name, str) or name not in rings:
        raise BadMessage(f"arrays in shared-memory ring {name!r}, which this node never opened")
    owner = getattr(rings[name], "owner", None)
    if owner is not None and owner != origin:
        raise BadMessage(
            f"arrays in ring {name!r} came on a connection other than the one that offered it"
        )
    if mark is not None and not (
        hasattr(rings[name], "stamp")
        and isinstance(mark, int)
        and not isinstance(mark, bool)
        and mark >= 0
    ):
        raise BadMessage(f"field 'm': mark {mark!r} is not a bulk channel's counter")
    if not any(p >= 0 for p in placed):
        return None, None
    return placed, mark


def _spec(i: int, spec: Any) -> tuple[np.dtype, list[int], int, int]:
    """Validate array spec ``i``: (dtype, shape, element count, bytes)."""
    if not (isinstance(spec, list) and len(spec) == 2):
        raise BadMessage(f"array spec {i} must be [dtype, shape]")
    dname, shape = spec
    dt = WIRE_DTYPES.get(dname) if isinstance(dname, str) else None
    if dt is None:
        raise BadMessage(f"array {i}: dtype {dname!r} is not allowed")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise BadMessage(f"array {i}: shape {shape!r} must be a list of non-negative integers")
    count = 1
    for d in shape:
        count *= d
    return dt, shape, count, count * dt.itemsize


def _decode_array(i, item, parts, placed, ring, target=None, lent=False) -> np.ndarray:
    """Array ``i`` from its frames (or ring slot), checked against its spec. A ring-borne
    array is copied into ``target`` if that is a flat, writable array of its dtype and
    element count, or given to ``target.land(view)`` (a read-only view of the ring, valid
    only during the call), whose return is the array; with ``lent`` it is a read-only view
    of the ring."""
    dt, shape, count, expected = item
    if placed is not None and placed[i] >= 0:
        if len(_buffer(parts[0])) != 0:
            raise BadMessage(f"array {i} is in shared memory but its frame is not empty")
        fits = (
            isinstance(target, np.ndarray)
            and target.dtype == dt
            and target.size == count
            and target.ndim == 1
            and target.flags.c_contiguous
            and target.flags.writeable
        )
        try:
            if fits:
                ring.take(placed[i], expected, out=target.view(np.uint8))
                return target.reshape(shape)
            if count and hasattr(target, "land"):  # (it copies what it takes: one copy)
                view = np.frombuffer(ring.take(placed[i], expected, view=True), dt)
                return target.land(view.reshape(shape))
            buf = memoryview(ring.take(placed[i], expected, view=lent))
        except ValueError as exc:
            raise BadMessage(f"array {i}: {exc}") from None
    elif len(parts) == 1:
        buf = _buffer(parts[0])
    else:  # split over several frames: every frame but the last is exactly FRAME_MAX
        bufs = [_buffer(p) for p in parts]
        sizes = [len(b) for b in bufs]
        if any(s != FRAME_MAX for s in sizes[:-1]) or sum(sizes) != expected:
            raise BadMessage(
                f"array {i}: its {len(parts)} frames hold {sum(sizes)} bytes but dtype "
                f"{dt.name} shape {shape} needs {expected} in frames of {FRAME_MAX}"
            )
        joined = np.empty(expected, np.uint8)
        at = 0
        for b in bufs:
            joined[at : at + len(b)] = np.frombuffer(b, np.uint8)
            at += len(b)
        buf = memoryview(joined)
    if len(buf) != expected:
        raise BadMessage(
            f"array {i}: frame holds {len(buf)} bytes but dtype {dt.name} shape {shape} "
            f"needs {expected}"
        )
    if count:
        return np.frombuffer(buf, dtype=dt).reshape(shape)
    try:  # no elements, but numpy still refuses dimensions whose product overflows
        return np.empty(shape, dt)
    except ValueError as exc:
        raise BadMessage(f"array {i}: shape {shape!r}: {exc}") from None
