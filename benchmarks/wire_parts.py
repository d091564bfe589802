#!/usr/bin/env python
"""Where a secured byte's time goes between hosts: the parts of the wire, one at a time.

    .venv/bin/python benchmarks/wire_parts.py [--mb 256] [--frame-mb 4] [--repeats 5]

One stream of ``--mb`` MB in frames of ``--frame-mb`` MB from one process to another over
loopback TCP (DEALER to ROUTER, zero-copy sends), medians of ``--repeats``:

* ``plain``: ZeroMQ without security (the baseline: kernel copies and ZeroMQ's own);
* ``curve``: the same connection with CurveZMQ (what every byte paid before the bulk channels);
* ``bulk``: the plain connection with each frame sealed by AES-256-GCM before it is sent and
  opened after it is received, as hetps' bulk channels do (transport/bulk.py);
* ``seal`` and ``open``: AES-256-GCM alone on one core, no connection.

Each is printed as GB/s and as a ratio of ``plain``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np
import zmq
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import machine_info, print_table  # noqa: E402

KEY = bytes(range(32))


def _keys():
    pub, sec = zmq.curve_keypair()
    return pub, sec


def _receiver(port_q, mode: str, total: int, frame: int, keys, done_q) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    if mode == "curve":
        s.setsockopt(zmq.CURVE_SERVER, 1)
        s.setsockopt(zmq.CURVE_SECRETKEY, keys[1])
    port = s.bind_to_random_port("tcp://127.0.0.1")
    port_q.put(port)
    aead = AESGCM(KEY)
    out = np.empty(frame, np.uint8)
    s.recv_multipart()  # the sender's first, empty frame: the connection is up
    got = 0
    while got < total:
        _, data = s.recv_multipart(copy=False)
        if mode == "bulk":
            aead.decrypt_into(b"\0" * 12, data.buffer, b"", out)
            got += len(data.buffer) - 16
        else:
            got += len(data.buffer)
    done_q.put(time.perf_counter())
    s.close(linger=0)
    ctx.term()


def stream(mode: str, total: int, frame: int) -> float:
    """Seconds to move ``total`` bytes one way (from the first send to the last receive)."""
    keys = _keys()
    port_q, done_q = mp.Queue(), mp.Queue()
    p = mp.Process(target=_receiver, args=(port_q, mode, total, frame, keys, done_q))
    p.start()
    port = port_q.get(timeout=30)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    if mode == "curve":
        cli_pub, cli_sec = zmq.curve_keypair()
        s.setsockopt(zmq.CURVE_SERVERKEY, keys[0])
        s.setsockopt(zmq.CURVE_PUBLICKEY, cli_pub)
        s.setsockopt(zmq.CURVE_SECRETKEY, cli_sec)
    s.connect(f"tcp://127.0.0.1:{port}")
    s.send(b"")  # (the connection is up before the clock starts)
    payload = np.random.default_rng(0).integers(0, 255, frame, dtype=np.uint8)
    aead = AESGCM(KEY)
    t0 = time.perf_counter()
    for _ in range(total // frame):
        if mode == "bulk":
            s.send(aead.encrypt(b"\0" * 12, payload, b""), copy=False)
        else:
            s.send(payload, copy=False)
    end = done_q.get(timeout=300)
    p.join()
    s.close(linger=0)
    ctx.term()
    return end - t0


def cipher(total: int, frame: int, open_: bool) -> float:
    aead = AESGCM(KEY)
    data = np.random.default_rng(0).integers(0, 255, frame, dtype=np.uint8)
    sealed = aead.encrypt(b"\0" * 12, data, b"")
    out = np.empty(frame, np.uint8)
    t0 = time.perf_counter()
    for _ in range(total // frame):
        if open_:
            aead.decrypt_into(b"\0" * 12, sealed, b"", out)
        else:
            aead.encrypt(b"\0" * 12, data, b"")
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--frame-mb", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    frame = args.frame_mb << 20
    total = (args.mb << 20) // frame * frame
    times: dict[str, list[float]] = {k: [] for k in ("plain", "curve", "bulk", "seal", "open")}
    for _ in range(args.repeats):  # alternated, so load changes hit every part alike
        for mode in ("plain", "curve", "bulk"):
            times[mode].append(stream(mode, total, frame))
        times["seal"].append(cipher(total, frame, False))
        times["open"].append(cipher(total, frame, True))
    med = {k: statistics.median(v) for k, v in times.items()}
    m = machine_info()
    print(f"machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores; load {os.getloadavg()}")
    print(f"{total >> 20} MB in {args.frame_mb} MB frames, medians of {args.repeats}")
    rows = [
        [k, f"{med[k]:.3f}", f"{total / med[k] / 1e9:.2f}", f"{med['plain'] / med[k]:.2f}"]
        for k in times
    ]
    print_table(["part", "s", "GB/s", "speed / plain"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
