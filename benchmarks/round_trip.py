"""The cost of one small round trip: a 4-byte push+pull on hetps against a raw pyzmq echo.

    .venv/bin/python benchmarks/round_trip.py [--repeats 5] [--rounds 2000] [--json FILE]

Both sides run as separate processes on 127.0.0.1, alternated run by run (A B A B):

* hetps: ``hetps launch -n 1 -s 1`` (1 worker, 1 server, ``dist_sync``) of a script that
  pushes a 4-byte key and pulls it into a preallocated array, ``--rounds`` times after a
  warm-up, and prints the median of its per-round times. Once the worker has pulled what it
  pushed, the push carries the value back and the pull sends nothing: one request per round.
* raw pyzmq: a DEALER sends a 2-frame message (a small header and the same 4 bytes) to a
  ROUTER echo in another process and waits for the echo, ``--rounds`` times.

Prints the medians over ``--repeats`` runs and the ratio hetps / raw (issue 20's goal: at
most 1.5).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HETPS_SCRIPT = """
import statistics, sys, time
import numpy as np
import hetps.kv
kv = hetps.kv.create('dist_sync')
a = np.ones(1, np.float32)
kv.init('k', a)
rounds = int(sys.argv[1])
times = []
for i in range(rounds + 200):
    t = time.perf_counter()
    kv.push('k', a)
    kv.pull('k', out=a)
    if i >= 200:
        times.append(time.perf_counter() - t)
print(f'ROUND-TRIP {statistics.median(times):.9f}', flush=True)
"""

ECHO_SERVER = """
import sys, zmq
ctx = zmq.Context()
r = ctx.socket(zmq.ROUTER)
port = r.bind_to_random_port('tcp://127.0.0.1')
print(port, flush=True)
while True:
    frames = r.recv_multipart()
    if frames[1] == b'stop':
        break
    r.send_multipart(frames)
"""


def run_hetps(rounds: int, timeout: float) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "rt.py"
        script.write_text(textwrap.dedent(HETPS_SCRIPT))
        cmd = [sys.executable, "-m", "hetps.cli", "launch", "-n", "1", "-s", "1", "--"]
        out = subprocess.run(
            [*cmd, sys.executable, str(script), str(rounds)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
    match = re.search(r"ROUND-TRIP ([0-9.]+)", out.stdout + out.stderr)
    if out.returncode != 0 or match is None:
        raise SystemExit(f"hetps run failed (exit {out.returncode}):\n{out.stdout}{out.stderr}")
    return float(match.group(1))


def run_zmq(rounds: int, timeout: float) -> float:
    import zmq

    server = subprocess.Popen(
        [sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE, text=True
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        port = int(server.stdout.readline())
        sock.connect(f"tcp://127.0.0.1:{port}")
        header, payload = b"\x00" * 24, b"\x00\x00\x80\x3f"
        times = []
        for i in range(rounds + 200):
            t = time.perf_counter()
            sock.send_multipart([header, payload])
            sock.recv_multipart()
            if i >= 200:
                times.append(time.perf_counter() - t)
        sock.send_multipart([b"stop"])
        server.wait(timeout)
        return statistics.median(times)
    finally:
        sock.close()
        ctx.term()
        if server.poll() is None:
            server.kill()
            server.wait()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for r in range(args.repeats):
        order = ("hetps", "zmq") if r % 2 == 0 else ("zmq", "hetps")
        got = {}
        for who in order:
            got[who] = (run_hetps if who == "hetps" else run_zmq)(args.rounds, args.timeout)
        rows.append(got)
        print(
            f"repeat {r + 1}: hetps {got['hetps'] * 1e6:.0f} us, raw zmq {got['zmq'] * 1e6:.0f} us, "
            f"ratio {got['hetps'] / got['zmq']:.2f}",
            flush=True,
        )
    h = statistics.median(x["hetps"] for x in rows)
    z = statistics.median(x["zmq"] for x in rows)
    ratios = [x["hetps"] / x["zmq"] for x in rows]
    print(
        f"\n4-byte push+pull (hetps, 1w/1s) {h * 1e6:.0f} us; raw pyzmq echo {z * 1e6:.0f} us; "
        f"hetps/raw {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] "
        f"(goal <= 1.5)"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"rounds": args.rounds, "runs": rows, "hetps_s": h, "zmq_s": z}, indent=1)
        )


if __name__ == "__main__":
    main()
