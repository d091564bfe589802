"""What a chunk request's body costs the server: declared types (msgspec) against hand checks.

    .venv/bin/python benchmarks/typed_messages.py [--repeats 41] [--number 5000] [--json FILE]

Small requests are where the per-request cost shows: a push of one float32 and a pull of one,
their header frames made by the codec from the body a worker sends
(:func:`hetps.cluster.bodies.chunk`, with the push window's receipt asked for). Three ways
of taking each request, alternated within every repeat (the order rotating from repeat to
repeat), each timed over ``--number`` calls by the thread's CPU time (``--wall``: the wall
clock; on a shared machine it also counts other processes' time); the figures are the medians
over ``--repeats`` of the time per call:

* ``hand``: ``codec.decode`` of the frames, then the checks the server made by hand on the
  body map before its bodies were declared types (copied below, as they were): key, part,
  offset and count, the slice, shape and dtype, the payload, the chunk size, the receipt,
  the round and sync fields.
* ``typed``: ``codec.decode``, then what the server runs now: the body converted into its
  declared type (:func:`hetps.kvstore.checks.body`: msgspec checks every type and bound in C
  and refuses unknown fields), then the checks that need the server's state
  (``find_slice``, ``push_data``, the chunk's alignment).
* ``header``: msgspec decoding the header bytes itself (the body as raw bytes decoded into
  its declared type), the arrays laid out as the codec's fast path does, then the same
  state checks: what replacing the codec's msgpack decode would give (not what runs).

The body checks alone (without the header decode) are timed too: ``hand-body`` and
``typed-body``; and the worker's side, building a push's body: ``hand-build`` (the map
literal the worker wrote) and ``chunk-build`` (:func:`hetps.cluster.bodies.chunk`). Ratios
are against the hand way (below 1: faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from hetps.cluster import bodies  # noqa: E402
from hetps.cluster import protocol as P  # noqa: E402
from hetps.kvstore import checks  # noqa: E402
from hetps.kvstore.placement import chunk_elems  # noqa: E402
from hetps.kvstore.slices import BadRequest, Slice, short  # noqa: E402
from hetps.transport import codec  # noqa: E402
from hetps.transport.codec import WIRE_DTYPES, Message, dtype_str  # noqa: E402

MAX_BYTES = 1 << 30


# -- the hand checks, as the server made them on the body map ----------------------------------
def _field(msg: Message, name: str, kind: Any) -> Any:
    value = msg.body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise BadRequest(f"{msg.cmd}: field {name!r} missing or not {kind}")
    return value


def _key_range(msg: Message) -> tuple[Any, int, int, int]:
    key = msg.body.get("k")
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise BadRequest(f"{msg.cmd}: key {short(key)} must be an int or a str")
    if isinstance(key, str) and len(key) > 1024:
        raise BadRequest(f"{msg.cmd}: a key of {len(key)} characters is longer than 1024")
    part = _field(msg, "part", int)
    off = _field(msg, "off", int)
    n = _field(msg, "n", int)
    if off < 0 or n < 0:
        raise BadRequest(f"{msg.cmd} of key {key!r}: negative offset or length")
    return key, part, off, n


def _find_slice(slices: dict, msg: Message, key: Any, part: int, off: int, n: int) -> Slice:
    sl = slices.get((key, part))
    if sl is None:
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
        raise BadRequest(f"{msg.cmd} of key {key!r}: shape or dtype does not match")
    if off + n > sl.value.size:
        raise BadRequest(f"{msg.cmd} of key {key!r}: range outside part {part}")
    return sl


def _push_data(msg: Message, sl: Slice, n: int) -> np.ndarray:
    if len(msg.arrays) != 1:
        raise BadRequest("expected one array")
    data = msg.arrays[0].reshape(-1)
    threshold = msg.body.get("comp")
    if threshold is not None:
        if (
            not isinstance(threshold, (int, float))
            or isinstance(threshold, bool)
            or not 0 < threshold < float("inf")
        ):
            raise BadRequest(f"push of key {sl.key!r}: bad compression threshold {threshold!r}")
        return data
    if data.dtype != sl.value.dtype or data.size != n:
        raise BadRequest(f"{msg.cmd} of key {sl.key!r}: payload does not fit")
    return data


def hand_push(msg: Message, slices: dict) -> Any:
    if "tag" in msg.body:
        _field(msg, "tag", int)
    receipt = msg.body.get("rcpt") is True and not msg.body.get("_rcpt_sent")
    key, part, off, n = _key_range(msg)
    sl = _find_slice(slices, msg, key, part, off, n)
    sync = bool(msg.body.get("sync", True))
    if "rnd" in msg.body:
        rnd = msg.body.get("rnd")
        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
            raise BadRequest(f"push of key {key!r}: field 'rnd' must be an integer >= 0")
    data = _push_data(msg, sl, n)
    ce = msg.body.get("ce")
    if not isinstance(ce, int) or isinstance(ce, bool) or ce <= 0:
        raise BadRequest(f"push of key {key!r}: field 'ce' (chunk elements) must be > 0")
    if off % ce or n != min(ce, sl.value.size - off):
        raise BadRequest(f"push of key {key!r}: not a chunk of {ce} elements")
    return data, sync, receipt, msg.body.get("pp") is True


def hand_pull(msg: Message, slices: dict) -> Any:
    key, part, off, n = _key_range(msg)
    return _find_slice(slices, msg, key, part, off, n), off, n


# -- the declared types, as the server runs them -----------------------------------------------
def typed_push(msg: Message, slices: dict) -> Any:
    b = checks.body(msg, bodies.Push)
    sl = checks.find_slice(slices, msg, b)
    data = checks.push_data(msg, sl, b, packed=True)
    off, n, ce = b.offset, b.count, b.chunk
    if off % ce or n != min(ce, sl.value.size - off):
        raise BadRequest(f"push of key {b.key!r}: not a chunk of {ce} elements")
    return data, b.sync, b.receipt, b.fused


def typed_pull(msg: Message, slices: dict) -> Any:
    b = checks.body(msg, bodies.Pull)
    return checks.find_slice(slices, msg, b), b.offset, b.count


# -- msgspec decoding the header itself (not what runs) ----------------------------------------
class Header(msgspec.Struct):
    v: int
    c: str
    r: int
    p: bool
    b: msgspec.Raw
    o: int = 0
    t: float = 0.0
    a: list[tuple[str, list[int]]] = []


_HEADER = msgspec.msgpack.Decoder(Header)
_BODY = {cmd: msgspec.msgpack.Decoder(kind) for cmd, kind in bodies.TYPES.items()}


def header_decode(frames: list, check, slices: dict) -> Any:
    h = _HEADER.decode(frames[0])
    if h.v != codec.VERSION or len(h.a) != len(frames) - 1:
        raise ValueError("bad header")
    try:
        typed = _BODY[h.c].decode(h.b)
    except msgspec.ValidationError as exc:
        raise BadRequest(str(exc)) from None
    arrays = []
    for (dname, shape), frame in zip(h.a, frames[1:], strict=True):
        dt = WIRE_DTYPES[dname]
        count = 1
        for d in shape:
            count *= d
        if len(frame) != count * dt.itemsize:
            raise ValueError("bad frame")
        arr = np.frombuffer(frame, dtype=dt)
        arrays.append(arr if len(shape) == 1 else arr.reshape(shape))
    msg = Message(h.c, req=h.r, reply=h.p, priority=h.o, arrays=arrays, sent_at=h.t)
    msg.typed = typed
    return check(msg, slices)


# -- the run -----------------------------------------------------------------------------------
def requests() -> tuple[dict, dict[str, list[bytes]]]:
    """The server's slice of key ``w0`` (one float32) and the frames of a push and a pull."""
    value = np.zeros(1, np.float32)
    slices = {("w0", 0): Slice("w0", 0, (1,), value)}
    step = chunk_elems(4 << 20, 4)
    push = bodies.chunk("w0", 0, 0, 1, (1,), "float32", sync=True, chunk=step, receipt=True)
    pull = bodies.chunk("w0", 0, 0, 1, (1,), "float32")
    frames = {}
    for cmd, body, arrays in (
        (P.PUSH, push, [np.ones(1, np.float32)]),
        (P.PULL, pull, []),
    ):
        encoded = codec.encode(Message(cmd, req=7, body=body, arrays=arrays))
        frames[cmd] = [bytes(memoryview(f)) for f in encoded]
    return slices, frames


def literal_push(k: Any, index: int, a: int, b: int, step: int, meta_shape: tuple) -> dict:
    """The push body as the worker wrote it before :func:`hetps.cluster.bodies.chunk`."""
    body = {
        "k": k,
        "part": index,
        "off": a,
        "n": b - a,
        "sync": True,
        "ce": step,
        "shape": list(meta_shape),
        "dtype": "float32",
    }
    dest, copies, comp = None, False, None
    if dest is not None:
        body["pp"] = True
    if copies:
        body["rnd"] = 0
    if comp is not None:
        body["comp"] = comp
    return body


def chunk_push(k: Any, index: int, a: int, b: int, step: int, meta_shape: tuple) -> dict:
    """The push body as the worker builds it now."""
    dest, copies, comp = None, False, None
    return bodies.chunk(
        k,
        index,
        a,
        b - a,
        meta_shape,
        "float32",
        sync=True,
        chunk=step,
        fused=True if dest is not None else None,
        round=0 if copies else None,
        threshold=comp,
    )


#: each way's baseline
BASE = {"typed": "hand", "header": "hand", "typed-body": "hand-body", "chunk-build": "hand-build"}


def variants(slices: dict, frames: dict) -> dict[str, Any]:
    out = {
        "push hand-build": lambda: literal_push("w0", 0, 0, 1, 1 << 20, (1,)),
        "push chunk-build": lambda: chunk_push("w0", 0, 0, 1, 1 << 20, (1,)),
    }
    for cmd, hand, typed in ((P.PUSH, hand_push, typed_push), (P.PULL, hand_pull, typed_pull)):
        fr = frames[cmd]
        decoded = codec.decode(fr, MAX_BYTES)

        def fresh(decoded=decoded) -> Message:
            return Message(decoded.cmd, req=decoded.req, body=decoded.body, arrays=decoded.arrays)

        out[f"{cmd} hand"] = lambda fr=fr, h=hand: h(codec.decode(fr, MAX_BYTES), slices)
        out[f"{cmd} typed"] = lambda fr=fr, t=typed: t(codec.decode(fr, MAX_BYTES), slices)
        out[f"{cmd} header"] = lambda fr=fr, t=typed: header_decode(fr, t, slices)
        out[f"{cmd} hand-body"] = lambda f=fresh, h=hand: h(f(), slices)
        out[f"{cmd} typed-body"] = lambda f=fresh, t=typed: t(f(), slices)
    return out


def timed(fn, number: int, clock=time.thread_time_ns) -> float:
    """Microseconds per call of ``fn`` over ``number`` calls, by this thread's CPU time (on
    a loaded machine the wall clock also counts the time other processes ran)."""
    t0 = clock()
    for _ in range(number):
        fn()
    return (clock() - t0) / number / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--number", type=int, default=5000, help="calls per timing")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument(
        "--wall", action="store_true", help="time by the wall clock, not the thread's CPU time"
    )
    args = ap.parse_args()
    slices, frames = requests()
    runs = variants(slices, frames)
    for fn in runs.values():  # each gives the same answer, and warms up
        fn()
    names = list(runs)
    samples: dict[str, list[float]] = {n: [] for n in names}
    clock = time.perf_counter_ns if args.wall else time.thread_time_ns
    load0 = os.getloadavg()
    for rep in range(args.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            samples[name].append(timed(runs[name], args.number, clock))
    load1 = os.getloadavg()
    med = {n: statistics.median(v) for n, v in samples.items()}
    print(f"header bytes: push {len(frames[P.PUSH][0])}, pull {len(frames[P.PULL][0])}")
    print(
        f"{args.repeats} repeats x {args.number} calls, {os.cpu_count()} cores, load average "
        f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end"
    )
    print(f"time per call ({'wall clock' if args.wall else 'CPU time of the timing thread'}):")
    print(f"{'request':<8} {'way':<11} {'us/call':>8} {'p25':>7} {'p75':>7} {'/ hand':>7}")
    for name in names:
        cmd, way = name.split()
        base = med[f"{cmd} {BASE.get(way, way)}"]
        q = statistics.quantiles(samples[name], n=4)
        print(
            f"{cmd:<8} {way:<11} {med[name]:8.2f} {q[0]:7.2f} {q[2]:7.2f} {med[name] / base:7.2f}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"median_us": med, "samples_us": samples, "load": [load0, load1]}, indent=1)
        )


if __name__ == "__main__":
    main()
