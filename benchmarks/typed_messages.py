"""What taking a request costs a receiver: the header's decode and the body's declared type,
against the path before (msgpack's decode, then checks by hand), for every command.

    .venv/bin/python benchmarks/typed_messages.py [--repeats 21] [--number 2000] [--json FILE]

Every way is timed over ``--number`` calls by the thread's CPU time (``--wall``: the wall
clock; on a shared machine it also counts other processes' time), the ways alternated within
every repeat (the order rotating from repeat to repeat); the figures are the medians over
``--repeats`` of the time per call. Ratios are against the way before (below 1: faster).

Small chunk requests, where the per-request cost shows: a push of one float32 and a pull of
one, their frames made by the codec from the body a worker sends (:func:`hetps.cluster.bodies.chunk`,
the push window's receipt asked for):

* ``hand``: the header decoded as before (msgpack, then each field checked in Python: the
  codec's quick path as it was, copied below), then the checks the server made by hand on
  the body map before its bodies were declared types (copied below, as they were).
* ``before``: the same header decode, then the body converted into its declared type as the
  handler did (:func:`hetps.kvstore.checks.body`), then the checks that need the server's
  state (``find_slice``, ``push_data``, the chunk's alignment).
* ``now``: what runs: ``codec.decode`` (msgspec decodes the header into
  :class:`hetps.transport.codec.Header` in C), the dispatch's decode of the body into its
  command's type (:func:`hetps.cluster.commands.decode`), then the same state checks.

The body checks alone (without the header) are timed too: ``hand-body`` and ``typed-body``;
and the header alone: ``header-before`` (msgpack) and ``header-now`` (msgspec); and the
worker's side, building a push's body: ``hand-build`` (the map literal the worker wrote) and
``chunk-build`` (:func:`hetps.cluster.bodies.chunk`).

Every other command: a body as its sender makes it (:data:`SAMPLES`), its frames made by
the codec. ``before`` is the header decoded as before with the body left a map (the checks
each handler made on it by hand are not counted: the ratio is the most the declared type can
cost); ``now`` is ``codec.decode`` and the dispatch's decode into the command's type.
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

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from hetps.cluster import bodies, commands  # noqa: E402
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


# -- the codec's quick path before msgspec decoded the header (as it was) ----------------------
def plain_msgpack(frames: list, max_bytes: int) -> Message | None:
    head = memoryview(frames[0])
    size = len(head)
    if size > codec.MAX_HEADER_BYTES:
        return None
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001
        return None
    if type(header) is not dict or header.get("v") != codec.VERSION or "m" in header:
        return None
    get = header.get
    cmd = get("c")
    req = get("r")
    reply = get("p")
    prio = get("o", 0)
    body = get("b", {})
    specs = get("a", [])
    sent_at = get("t", 0.0)
    if (
        type(cmd) is not str
        or not cmd
        or len(cmd) > 64
        or not (cmd.isascii() and cmd.isprintable())
        or type(req) is not int
        or type(prio) is not int
        or type(reply) is not bool
        or type(body) is not dict
        or (type(sent_at) is not float and type(sent_at) is not int)
        or type(specs) is not list
        or len(specs) != len(frames) - 1
    ):
        return None
    layout = []
    for spec in specs:
        if type(spec) is not list or len(spec) != 2:
            return None
        dname, shape = spec
        dt = WIRE_DTYPES.get(dname) if type(dname) is str else None
        if dt is None or type(shape) is not list or len(shape) > codec.MAX_DIMS:
            return None
        count = 1
        for d in shape:
            if type(d) is not int or d < 0:
                return None
            count *= d
        expected = count * dt.itemsize
        if not count or expected > codec.FRAME_MAX:
            return None
        size += expected
        layout.append((dt, shape, expected))
    if size > max_bytes:
        return None
    arrays = []
    for i, (dt, shape, expected) in enumerate(layout):
        buf = memoryview(frames[i + 1])
        if len(buf) != expected:
            return None
        arr = np.frombuffer(buf, dtype=dt)
        arrays.append(arr if len(shape) == 1 else arr.reshape(shape))
    return Message(
        cmd=cmd,
        req=req,
        reply=reply,
        priority=prio,
        body=body,
        arrays=arrays,
        sent_at=float(sent_at),
        nbytes=size,
    )


def before_decode(frames: list) -> Message:
    """The codec's decode as it was (its quick path; every message here takes it)."""
    msg = plain_msgpack(frames, MAX_BYTES)
    assert msg is not None
    return msg


def now_decode(frames: list) -> Message:
    """What a receiver runs now: the codec, then the dispatch's decode of the body."""
    msg = codec.decode(frames, MAX_BYTES)
    why = commands.decode(msg)
    if why is not None:
        raise BadRequest(why)
    return msg


NODE = [9, "worker", 0, "127.0.0.1", 40001]
TABLE = {"k": "emb", "part": 0}
_PULL = bodies.chunk("w0", 0, 0, 1, (1,), "float32")
#: a body of every command as its sender makes it (and the arrays it carries)
SAMPLES: dict[str, tuple[dict, list]] = {
    P.ADD_NODE: (
        {
            "role": "worker",
            "host": "127.0.0.1",
            "port": 40001,
            "back": b"\x01" * 16,
            "want_rank": -1,
        },
        [],
    ),
    P.READMIT: (
        {
            "id": 9,
            "role": "worker",
            "rank": 0,
            "host": "127.0.0.1",
            "port": 40001,
            "back": b"\x01" * 16,
            "cred": b"c" * 32,
            "gen": 0,
            "view": {
                "nodes": [[8, "server", 0, "127.0.0.1", 40000], NODE],
                "down": [],
                "redirect": [],
                "done": [],
                "barriers": {"worker": 3, "all": 1},
                "replicas": 1,
            },
        },
        [],
    ),  # fmt: skip
    P.HEARTBEAT: ({}, []),
    P.BARRIER: ({"group": "worker", "n": 3}, []),
    P.FINISH: ({}, []),
    P.LEAVE: ({"reason": "RuntimeError: out of memory"}, []),
    P.JOIN: ({}, []),
    P.ADMIT: ({"rounds": [["w0", 3], ["w1", 3]], "tables": []}, [np.zeros(64, np.uint8)]),
    P.ENTERED: ({}, []),
    P.ESYNC_REPORT: (
        {"rank": 0, "round": 3, "step_s": 0.01, "elapsed_s": 0.03, "ep": "127.0.0.1:40001"},
        [],
    ),
    P.BALANCE_REPORT: (
        {
            "round": 3,
            "samples": [[9, 8, 4096.0, 1.0, 1.001, 0]] * 8,
            "server_times": {"0": [4096, 0.01]},
        },
        [],
    ),
    P.METRICS_REPORT: (
        {"seq": 3, "t": 1.5, "rounds": 3, "links": [[0, 4096, 4096]], "round_s": 0.01},
        [],
    ),
    P.INIT: (bodies.chunk("w0", 0, 0, 1, (1,), "float32", size=1), [np.ones(1, np.float32)]),
    P.PUSH: (
        bodies.chunk("w0", 0, 0, 1, (1,), "float32", sync=True, chunk=1 << 20, receipt=True),
        [np.ones(1, np.float32)],
    ),
    P.PULL: (_PULL, []),
    P.BATCH: ({"items": [[P.PULL, 5, _PULL, 0], [P.PULL, 6, _PULL, 0]]}, []),
    P.SET_OPTIMIZER: ({}, [np.zeros(64, np.uint8)]),
    P.GET_STATES: ({"slices": [["w0", 0]]}, []),
    P.SET_STATES: ({"move": True}, [np.zeros(64, np.uint8)]),
    P.FORECAST: ({"tag": 5}, []),
    P.PROBE: ({"reply_bytes": 0, "spread": True, "tag": 5}, [np.zeros(64, np.uint8)]),
    P.DROP: ({"slices": [["w0", 0, 10]]}, []),
    P.ENTER: ({}, []),
    P.REPLICATE: (
        {"op": "round", "k": "w0", "part": 0, "rnd": 3, "mode": "grad"},
        [np.ones(1, np.float32)],
    ),
    P.SINIT: (
        {
            **TABLE,
            "nparts": 1,
            "rows": 1000,
            "cols": 8,
            "dtype": "float32",
            "scale": 0.1,
            "seed": 0,
            "bound": 0,
        },
        [],
    ),  # fmt: skip
    P.SPUSH: (
        {**TABLE, "sync": True},
        [np.arange(2, dtype=np.int64), np.ones(16, np.float32)],
    ),
    P.SPULL: (TABLE, [np.arange(2, dtype=np.int64)]),
    P.SDUMP: ({**TABLE, "off": 0, "n": 512}, []),
    P.SLOAD: (
        {**TABLE, "fresh": True, "state": ["mom"], "numbers": {}},
        [np.arange(2, dtype=np.int64), np.ones(16, np.float32), np.ones(16, np.float32)],
    ),
    P.RECEIPT: ({"req": 5}, []),
    P.WORKER_DONE: ({"node": NODE}, []),
    P.EXIT: ({}, []),
    P.NODE_DEAD: ({"node": NODE, "error": "no heartbeat for 30 s"}, []),
    P.FAILOVER: ({"node": [8, "server", 0, "127.0.0.1", 40000], "error": "died", "to": 10}, []),
    P.REJOIN: (
        {"node": [8, "server", 0, "127.0.0.1", 40000], "out": b"\x02" * 8, "in": b"\x03" * 8},
        [],
    ),
    P.WORKER_LEFT: ({"node": NODE, "error": "died", "workers": [11, 13]}, []),
    P.WORKER_JOINING: ({"node": NODE}, []),
    P.WORKER_BACK: ({"node": NODE, "workers": [9, 11, 13]}, []),
}


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
BASE = {
    "hand": "hand",
    "before": "hand",
    "now": "before",
    "typed-body": "hand-body",
    "header-now": "header-before",
    "chunk-build": "hand-build",
}


def variants(slices: dict, frames: dict) -> dict[str, Any]:
    """The chunk requests' ways, then every command's ``before`` and ``now``."""
    out = {
        "push hand-build": lambda: literal_push("w0", 0, 0, 1, 1 << 20, (1,)),
        "push chunk-build": lambda: chunk_push("w0", 0, 0, 1, 1 << 20, (1,)),
    }
    for cmd, hand, typed in ((P.PUSH, hand_push, typed_push), (P.PULL, hand_pull, typed_pull)):
        fr = frames[cmd]
        decoded = codec.decode(fr, MAX_BYTES)

        def fresh(decoded=decoded) -> Message:
            return Message(decoded.cmd, req=decoded.req, body=decoded.body, arrays=decoded.arrays)

        out[f"{cmd} hand"] = lambda fr=fr, h=hand: h(before_decode(fr), slices)
        out[f"{cmd} before"] = lambda fr=fr, t=typed: t(before_decode(fr), slices)
        out[f"{cmd} now"] = lambda fr=fr, t=typed: t(now_decode(fr), slices)
        out[f"{cmd} hand-body"] = lambda f=fresh, h=hand: h(f(), slices)
        out[f"{cmd} typed-body"] = lambda f=fresh, t=typed: t(f(), slices)
        out[f"{cmd} header-before"] = lambda fr=fr: before_decode(fr)
        out[f"{cmd} header-now"] = lambda fr=fr: codec.decode(fr, MAX_BYTES)
    for cmd, (body, arrays) in SAMPLES.items():
        if cmd in (P.PUSH, P.PULL):
            continue
        fr = [
            bytes(memoryview(f))
            for f in codec.encode(Message(cmd, req=7, body=body, arrays=list(arrays)))
        ]
        out[f"{cmd} before"] = lambda fr=fr: before_decode(fr)
        out[f"{cmd} now"] = lambda fr=fr: now_decode(fr)
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
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--number", type=int, default=2000, help="calls per timing")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument(
        "--wall", action="store_true", help="time by the wall clock, not the thread's CPU time"
    )
    args = ap.parse_args()
    slices, frames = requests()
    runs = variants(slices, frames)
    missing = set(commands.TYPES) - set(SAMPLES)
    assert not missing, f"no sample body of {sorted(missing)}"
    for fn in runs.values():  # each takes its request (a refused one raises), and warms up
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
    print(f"{'command':<15} {'way':<14} {'us/call':>8} {'p25':>7} {'p75':>7} {'ratio':>6}  (vs)")
    for name in names:
        cmd, way = name.split()
        base_way = BASE.get(way, way)
        if f"{cmd} {base_way}" not in med:  # (every other command's before: its own base)
            base_way = way
        base = med[f"{cmd} {base_way}"]
        q = statistics.quantiles(samples[name], n=4)
        vs = f"  ({base_way})" if base_way != way else ""
        print(
            f"{cmd:<15} {way:<14} {med[name]:8.2f} {q[0]:7.2f} {q[2]:7.2f} "
            f"{med[name] / base:6.2f}{vs}"
        )
    every = [n.split()[0] for n in names if n.endswith(" now")]
    ratios = [med[f"{c} now"] / med[f"{c} before"] for c in every]
    print(
        f"every command ({len(every)}), now / before: median {statistics.median(ratios):.2f}, "
        f"from {min(ratios):.2f} to {max(ratios):.2f}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"median_us": med, "samples_us": samples, "load": [load0, load1]}, indent=1)
        )


if __name__ == "__main__":
    main()
