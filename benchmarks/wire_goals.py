#!/usr/bin/env python
"""Bytes at the hardware's speed: every goal as a ratio, measured in one run.

    .venv/bin/python benchmarks/wire_goals.py [--repeats 3] [--json FILE] [--skip-mxnet]

It runs three benchmarks of this folder and judges their figures:

* ``kvstore_throughput.py``, 2 workers and 2 servers, 16, 64 and 256 MB, alternated run by run:
  hetps secured over TCP (``HETPS_SHM_BYTES=0``, as between hosts), plain over TCP, secured with
  the shared-memory rings, secured over TCP without the bulk channels (``HETPS_BULK_CHANNELS=0``:
  every byte through CurveZMQ), MXNet 1.9.1's own benchmark and a raw pyzmq echo of the same
  bytes (``--mx-python``/``--mx-bench`` say where MXNet's virtualenv and benchmark are).
  Goals: secured over TCP >= 1.0x MXNet (2 cores); secured >= 0.8 and plain >= 0.95 of the echo
  at 64 and 256 MB (16 cores); the rings' speed against MXNet at 16 and 64 MB holds (1.9-3.2x).
* ``server_update.py``: a server's SGD-momentum and Adam step on 11.7M float32 values against
  the same arithmetic in bare in-place torch on the same cores (goal <= 1.5x).
* ``cluster_scaling.py --model-mb 45``: one worker's round with 1 server over with 4 servers
  (goal >= 2.5x, 16 cores).

A goal stated for 16 cores is judged only on a machine with at least 16; elsewhere its ratio is
printed and marked "16-core goal". The machine is named with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _common import fmt, machine_info, print_table, write_json  # noqa: E402

SIZES = (16, 64, 256)


def log(text: str) -> None:
    print(f"[wire-goals {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run(argv: list[str], timeout: float) -> int:
    log(" ".join(argv[1:]))
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, timeout=timeout, check=False
    ).returncode


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def goals_from(kv: dict | None, upd: dict | None, scale: dict | None, cores: int) -> list[dict]:
    """Each goal's measured ratio and verdict from the three benchmarks' JSON reports (None
    where a benchmark did not run). ``cores``: this machine's, for the 16-core goals."""
    big = cores >= 16
    out: list[dict] = []

    def goal(name: str, value: float | None, ok: bool | None, where: str = "2 cores") -> None:
        if where == "16 cores" and not big:
            verdict = "16-core goal"
        elif value is None:
            verdict = "not measured"
        else:
            verdict = "met" if ok else "MISSED"
        out.append({"goal": name, "ratio": value, "verdict": verdict, "machine": where})

    sec = {r["size_mb"]: r for r in (kv or {}).get("security", []) if r["shape"] == "2w/2s"}
    thr = {r["size_mb"]: r for r in (kv or {}).get("throughput", []) if r["shape"] == "2w/2s"}
    for mb in SIZES:
        r = sec.get(mb, {})
        x = _ratio(r.get("mxnet_median_s"), r.get("median_s", {}).get("secure-tcp"))
        goal(f"secured over TCP, {mb} MB: MXNet / hetps >= 1.0", x, x is not None and x >= 1.0)
        # what the bulk channels (AES-256-GCM) bring over every byte through CurveZMQ
        x = _ratio(
            r.get("median_s", {}).get("secure-curve"), r.get("median_s", {}).get("secure-tcp")
        )
        goal(f"secured over TCP, {mb} MB: CURVE only / bulk channels > 1.0", x,
             x is not None and x > 1.0)  # fmt: skip
    for mb in (64, 256):
        r, t = sec.get(mb, {}), thr.get(mb, {})
        zmq = t.get("median_s", {}).get("zmq")
        for variant, bound in (("secure-tcp", 0.8), ("plain-tcp", 0.95)):
            x = _ratio(zmq, r.get("median_s", {}).get(variant))
            what = "secured" if variant == "secure-tcp" else "plain"
            goal(f"{what} over TCP, {mb} MB: of the raw echo >= {bound}", x,
                 x is not None and x >= bound, "16 cores")  # fmt: skip
    for mb in (16, 64):
        r = sec.get(mb, {})
        x = _ratio(r.get("mxnet_median_s"), r.get("median_s", {}).get("secure"))
        goal(f"shared memory, {mb} MB: MXNet / hetps holds (>= 1.9)", x, x is not None and x >= 1.9)
    cases = {c["case"]: c for c in (upd or {}).get("cases", [])}
    for case, label in (("sgd momentum", "SGD with momentum"), ("adam", "Adam")):
        x = cases.get(case, {}).get("hetps_over_torch")
        goal(f"server {label} step: hetps / bare torch <= 1.5", x, x is not None and x <= 1.5)
    rows = {r["servers"]: r for r in (scale or {}).get("rows", []) if r["workers"] == 1}
    x = _ratio(rows.get(1, {}).get("round_s"), rows.get(4, {}).get("round_s"))
    goal("45 MB round, 1 worker: 1 server / 4 servers >= 2.5", x, x is not None and x >= 2.5,
         "16 cores")  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="A B pairs (throughput, scaling)")
    ap.add_argument("--reps", type=int, default=10, help="timed rounds per size")
    ap.add_argument("--skip-mxnet", action="store_true")
    ap.add_argument("--mx-python", default=None, help="MXNet's python (kvstore_throughput.py's)")
    ap.add_argument("--mx-bench", default=None, help="MXNet's bench_mx.py (the same)")
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=list(SIZES))
    ap.add_argument("--update-elems", type=int, default=11_700_000)
    ap.add_argument("--scaling-mb", type=float, default=45.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per benchmark")
    args = ap.parse_args()
    machine = machine_info()
    tmp = tempfile.mkdtemp(prefix="hetps-wire-goals-")
    files = {k: os.path.join(tmp, f"{k}.json") for k in ("kv", "upd", "scale")}
    kv_cmd = [os.path.join(HERE, "kvstore_throughput.py"), "--shapes", "2x2",
              "--sizes-mb", *[f"{m:g}" for m in args.sizes_mb],
              "--variants", "secure-tcp", "plain-tcp", "secure", "secure-curve", "--skip",
              "startup", "memory", "growth", *(["mxnet"] if args.skip_mxnet else []),
              *(["--mx-python", args.mx_python] if args.mx_python else []),
              *(["--mx-bench", args.mx_bench] if args.mx_bench else []),
              "--repeats", str(args.repeats), "--reps", str(args.reps),
              "--json", files["kv"]]  # fmt: skip
    upd_cmd = [os.path.join(HERE, "server_update.py"), "--elems", str(args.update_elems),
               "--json", files["upd"]]  # fmt: skip
    scale_cmd = [os.path.join(HERE, "cluster_scaling.py"), "--model-mb", f"{args.scaling_mb:g}",
                 "--workers", "1", "--servers", "1", "4", "--repeats", str(args.repeats),
                 "--json", files["scale"]]  # fmt: skip
    for cmd in (kv_cmd, upd_cmd, scale_cmd):
        rc = run(cmd, args.timeout)
        if rc != 0:
            log(f"{os.path.basename(cmd[0])} ended with {rc}: its goals are not measured")
    loaded = {}
    for k, path in files.items():
        try:
            with open(path) as f:
                loaded[k] = json.load(f)
        except (OSError, json.JSONDecodeError):
            loaded[k] = None
    goals = goals_from(loaded["kv"], loaded["upd"], loaded["scale"], machine["cores"])
    print(f"\nmachine: {machine['cpu']}, {machine['cores']} cores, load {machine['loadavg']}")
    print_table(
        ["goal", "ratio", "verdict", "stated for"],
        [[g["goal"], fmt(g["ratio"], ".2f"), g["verdict"], g["machine"]] for g in goals],
    )
    if args.json:
        write_json(args.json, {"machine": machine, "goals": goals, "reports": loaded})
    return 0


if __name__ == "__main__":
    sys.exit(main())
