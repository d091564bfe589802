"""The cost of one small round trip: a 4-byte push+pull on hetps against MXNet 1.9.1 and a
raw pyzmq echo.

    .venv/bin/python benchmarks/round_trip.py [--repeats 5] [--rounds 2000] [--json FILE]

Every side runs as separate processes on 127.0.0.1, in turn within each repeat (the order
rotates from repeat to repeat):

* hetps: ``hetps launch -n 1 -s 1`` (1 worker, 1 server, ``dist_sync``) of a script that
  pushes a 4-byte key and pulls it into a preallocated array, ``--rounds`` times after a
  warm-up, and prints the median of its per-round times. Once the worker has pulled what it
  pushed, the push carries the value back and the pull sends nothing: one request per round.
* MXNet: the reference peer's ``bench_mx.py`` (``../shared/peers/mxnet``) with 1 worker and
  1 server, ``dist_sync``, one key of one float: ``kv.push(k, v); kv.pull(k, out=o);
  o.wait_to_read()``, ``--rounds`` times after 200 warm-up rounds, the median per round. Its
  python is ``--mxnet-python`` (default ``mxpeer-venv/bin/python`` at the repository root);
  without it the MXNet column is skipped and the output says so.
* raw pyzmq: a DEALER sends a 2-frame message (a small header and the same 4 bytes) to a
  ROUTER echo in another process and waits for the echo, ``--rounds`` times.

Prints the medians over ``--repeats`` runs, the ratio hetps / raw (issue 20's goal: at most
1.5), hetps / MXNet (below 1: hetps is faster) and MXNet / raw: where MXNet's own round trip
stands against the same echo.
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import free_port, run_group  # noqa: E402

MX_BENCH = ROOT.parent / "shared" / "peers" / "mxnet" / "bench_mx.py"
MX_PY = ROOT / "mxpeer-venv" / "bin" / "python"
WARMUP = 200

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
        cmd += [sys.executable, str(script), str(rounds)]
        # its own process group, stopped whole on a timeout (run_group)
        rc, lines = run_group([("hetps", cmd, dict(os.environ))], timeout)
    text = "\n".join(lines)
    match = re.search(r"ROUND-TRIP ([0-9.]+)", text)
    if rc != 0 or match is None:
        raise SystemExit(f"hetps run failed (exit {rc}):\n{text}")
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


class SideFailed(RuntimeError):
    """A baseline's run failed; the benchmark goes on without that side."""


def run_mxnet(rounds: int, timeout: float, python: Path) -> float:
    """MXNet's 4-byte push+pull round, the median of ``rounds`` (bench_mx.py's small keys)."""
    with tempfile.TemporaryDirectory() as tmp:
        out_json = Path(tmp) / "mx.json"
        cmd = [
            str(python), str(MX_BENCH), "--workers", "1", "--servers", "1",
            "--sizes-mb", "0.000004", "--reps", "1", "--warmup", str(WARMUP),
            "--small-keys", "1", "--small-elems", "1", "--small-reps", str(rounds),
            "--port", str(free_port()), "--json", str(out_json), "--timeout", str(timeout),
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "PORT"}  # ps-lite reads PORT
        # bench_mx.py starts its scheduler, server and worker in its own process group:
        # run_group stops all of them on a timeout or a failure
        rc, lines = run_group([("mxnet", cmd, env)], timeout + 60)
        if rc != 0 or not out_json.exists():
            raise SideFailed(f"MXNet run failed (exit {rc}):\n" + "\n".join(lines[-30:]))
        small = json.loads(out_json.read_text().splitlines()[-1])["results"][0]["small"]
    if not small["correct"]:
        raise SideFailed(f"MXNet's round trip pulled a wrong value: {small}")
    return float(small["median_s"])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--json", type=Path)
    p.add_argument("--mxnet-python", type=Path, default=MX_PY)
    p.add_argument("--skip-mxnet", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sides = {
        "hetps": lambda: run_hetps(args.rounds, args.timeout),
        "zmq": lambda: run_zmq(args.rounds, args.timeout),
    }
    if args.skip_mxnet:
        print("MXNet: skipped (--skip-mxnet)")
    elif not (args.mxnet_python.exists() and MX_BENCH.exists()):
        print(f"MXNet: skipped ({args.mxnet_python} or {MX_BENCH} is missing)")
    else:
        sides["mxnet"] = lambda: run_mxnet(args.rounds, args.timeout, args.mxnet_python)
    names = list(sides)
    rows = []
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        got = {}
        for who in order:
            try:
                got[who] = sides[who]()
            except SideFailed as exc:  # a baseline that fails leaves the rest of the run
                print(f"{who}: left out from here on: {exc}", flush=True)
        dropped = [who for who in names if who not in got]
        if dropped:
            names = [who for who in names if who in got]
            rows = [{k: v for k, v in row.items() if k in got} for row in rows]
        rows.append(got)
        line = ", ".join(f"{who} {got[who] * 1e6:.0f} us" for who in names)
        ratios = ", ".join(f"{a}/{b} {got[a] / got[b]:.2f}" for a, b in pairs(got))
        print(f"repeat {r + 1}: {line}; {ratios}", flush=True)
    med = {who: statistics.median(x[who] for x in rows) for who in names}
    print()
    for who, what in (("hetps", "hetps 4-byte push+pull, 1w/1s"), ("mxnet", "MXNet 1.9.1, the same"),
                      ("zmq", "raw pyzmq echo")):  # fmt: skip
        if who in med:
            print(f"{what}: {med[who] * 1e6:.0f} us per round (median of {len(rows)})")
    summary = {}
    for a, b in pairs(med):
        rs = [x[a] / x[b] for x in rows]
        summary[f"{a}/{b}"] = statistics.median(rs)
        goal = " (goal <= 1.5)" if (a, b) == ("hetps", "zmq") else ""
        print(f"{a}/{b} {statistics.median(rs):.2f} [{min(rs):.2f}-{max(rs):.2f}]{goal}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"rounds": args.rounds, "runs": rows, "medians_s": med, "ratios": summary},
                indent=1,
            )
        )


def pairs(got: dict) -> list[tuple[str, str]]:
    """The ratios worth printing among the sides that ran."""
    want = [("hetps", "zmq"), ("hetps", "mxnet"), ("mxnet", "zmq")]
    return [(a, b) for a, b in want if a in got and b in got]


if __name__ == "__main__":
    main()
