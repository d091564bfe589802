#!/usr/bin/env python
"""Where a small table round's time goes: hetps's and MXNet's rounds of a few rows and of
0.1% of a table against the bare messages of such a round, in the same run (2 workers, 2
servers, ``dist_sync``).

    .venv/bin/python benchmarks/message_floor.py [--repeats 3] [--rounds 300]
        [--bare-rounds 1000] [--mxnet-python PY] [--json FILE]

Systems, alternated job by job (the order reversed every other repeat):

* ``mxnet``, ``hetps shm``, ``hetps tcp``: rounds of ``benchmarks/sparse_tables.py`` on a
  1M x 16 table, SGD on the servers: push, then ``row_sparse_pull``, of 4 rows per worker
  (almost no table work: each system's floor, its messages and its requests' fixed steps)
  and of 0.1% of the rows (1,000 a worker), one job per system holding both. Started as
  sparse_tables.py starts them (MXNet only with ``--mxnet-python``; hetps secured, as by
  default).
* ``bare curve``, ``bare handoff``, ``bare zmq``, ``bare unix``: a round of 4 rows' messages
  and nothing else (``benchmarks/_bare_round.py``): a request of hetps's frames from each
  worker to each server, each server answering when it has both; pyzmq ROUTER and DEALER
  sockets over loopback, as hetps's nodes use them, with CURVE (as hetps's connections,
  encrypted), the same with each worker's answers read by a receive thread and handed to the
  caller (as hetps's worker does), without CURVE, and AF_UNIX SOCK_SEQPACKET sockets (one
  system call a message each way: no ZeroMQ I/O thread). Each server's count of requests
  answered is checked.

A cell: the median of every timed round of every repeat (worker 0's clock), and worker 0's
process CPU time per round (the median of the repeats); ``--json`` keeps every round and
each job's CPU, in µs. The difference between a system's
round of 4 rows and the bare round of its transport is what its own code (Python for hetps,
C++ for MXNet) adds to the messages; its round of 0.1% less its round of 4 rows, what the
table work adds.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _bare_round import WARM  # noqa: E402
from _common import (  # noqa: E402
    git_head,
    machine_info,
    markdown_table,
    median,
    print_table,
    run_group,
    write_json,
)
from sparse_tables import CPU, DEFAULT_MX_PY, RESULT, base_env, run_hetps, run_mxnet  # noqa: E402

BARE = re.compile(r"BARE (\w+) ([\d.e-]+) ([\d.,e-]+)")
SERVED = re.compile(r"SERVED (\w+) (\d+)")
TABLE_SYSTEMS = ("mxnet", "hetps shm", "hetps tcp")
BARE_MODES = ("curve", "handoff", "zmq", "unix")
FRACS = {0.000004: "4 rows", 0.001: "0.1%"}  # of a 1M-row table, per worker


def free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free now (the bare jobs' processes bind them), below the
    kernel's range of ephemeral ports: a connection made meanwhile (a process of the job
    connecting to a peer not listening yet) cannot take one as its own end."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        p = random.randrange(10000, max(10001, low - n))
        held = []
        try:
            for q in range(p, p + n):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", q))
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
        return p
    raise SystemExit(f"message_floor: found no {n} free ports side by side")


def run_bare(mode: str, rounds: int, timeout: float) -> tuple[int, list[str]]:
    """A bare job; started again (twice at most) when a port it took was taken meanwhile."""
    env = base_env()
    if mode in ("curve", "handoff"):
        import zmq

        public, secret = zmq.curve_keypair()
        env["BARE_SERVER_PUBLIC"], env["BARE_SERVER_SECRET"] = public.decode(), secret.decode()
    script = os.path.join(HERE, "_bare_round.py")
    for _ in range(3):
        env["BARE_TAG"] = secrets.token_hex(8)  # (the unix sockets' names)
        base = free_ports(4)
        procs = []
        for role in ("server", "worker"):
            for i in range(2):
                argv = [sys.executable, script, mode, role, str(i), str(base), str(rounds)]
                procs.append((f"{role}{i}", argv, env))
        rc, lines = run_group(procs, timeout)
        if rc == 0 or not any("Address already in use" in ln for ln in lines):
            break
    return rc, lines


def parse(system: str, lines: list[str], bare_rounds: int) -> dict:
    """{label: (rounds, CPU seconds a round)} of a job's output; SystemExit when it lacks a
    figure or a bare server answered another count of requests than the rounds'."""
    got: dict[str, list[float]] = {}
    cpus: dict[str, float] = {}
    served = []
    for ln in lines:
        m = RESULT.search(ln)
        if m:
            got[FRACS[float(m.group(2))]] = [float(x) for x in m.group(3).split(",")]
        m = CPU.search(ln)
        if m:
            cpus[FRACS[float(m.group(2))]] = float(m.group(3))
        m = BARE.search(ln)
        if m:
            got[""] = [float(x) for x in m.group(3).split(",")]
            cpus[""] = float(m.group(2))
        m = SERVED.search(ln)
        if m:
            served.append(int(m.group(2)))
    want = [""] if system.startswith("bare") else list(FRACS.values())
    if sorted(got) != sorted(want) or sorted(cpus) != sorted(want):
        raise SystemExit(f"message_floor: the {system} job gave {sorted(got)}, not {want}")
    asked = (bare_rounds + WARM) * 2  # (each worker's requests, the warm-up's too)
    if system.startswith("bare") and served != [asked] * 2:
        raise SystemExit(
            f"message_floor: the {system} servers answered {served} requests, not {asked} each"
        )
    return {k: (got[k], cpus[k]) for k in want}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=300, help="timed rounds of the table jobs")
    ap.add_argument("--bare-rounds", type=int, default=1000, help="timed rounds, bare jobs")
    ap.add_argument("--mxnet-python", default=DEFAULT_MX_PY)
    ap.add_argument("--job-timeout", type=float, default=600)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.rounds < 1 or args.bare_rounds < 1 or args.repeats < 1:
        ap.error("--repeats, --rounds and --bare-rounds take a count of at least 1")
    have_mx = os.path.exists(args.mxnet_python)
    if not have_mx:
        print(f"MXNet left out: no python at {args.mxnet_python} (see --mxnet-python)")
    table_args = SimpleNamespace(
        rows=1_000_000,
        cols="16",
        fracs=",".join(map(str, FRACS)),
        rounds=args.rounds,
        tables=1,
        job_timeout=args.job_timeout,
        mxnet_python=args.mxnet_python,
    )
    systems = [s for s in TABLE_SYSTEMS if have_mx or s != "mxnet"]
    systems += [f"bare {m}" for m in BARE_MODES]
    times: dict[str, list[float]] = {}  # "system" or "system, label": every timed round
    cpu: dict[str, list[float]] = {}  # the same keys: CPU seconds a round, one per job
    loads: list[float] = []
    for rep in range(args.repeats):
        for system in systems if rep % 2 == 0 else systems[::-1]:
            t0 = time.time()
            loads.append(os.getloadavg()[0])
            if system == "mxnet":
                rc, lines = run_mxnet(table_args, "sgd")
            elif system.startswith("hetps"):
                rc, lines = run_hetps(table_args, "sgd", shm=system == "hetps shm")
            else:
                rc, lines = run_bare(system.split()[1], args.bare_rounds, args.job_timeout)
            print(f"repeat {rep} {system}: {time.time() - t0:.1f} s, load {loads[-1]:.1f}")
            if rc != 0:
                print("\n".join(lines[-40:]))
                raise SystemExit(f"message_floor: the {system} job failed (exit code {rc})")
            for label, (rounds, used) in parse(system, lines, args.bare_rounds).items():
                key = f"{system}, {label}" if label else system
                times.setdefault(key, []).extend(rounds)
                cpu.setdefault(key, []).append(used)
    med = {k: median(v) for k, v in times.items()}
    used = {k: median(v) for k, v in cpu.items()}
    bare_of = {"mxnet": "bare zmq", "hetps shm": "bare curve", "hetps tcp": "bare curve"}
    headers = ["system", "round ms", "worker CPU ms", "over its bare messages ms"]
    headers.append("over its round of 4 rows ms")
    rows = []
    for key in times:
        system, _, label = key.partition(", ")
        over = bare_of.get(system) if label == "4 rows" else None
        floor = f"{system}, 4 rows" if label == "0.1%" else None
        rows.append(
            [
                key,
                f"{med[key] * 1e3:.3f}",
                f"{used[key] * 1e3:.3f}",
                f"{(med[key] - med[over]) * 1e3:.3f} ({over})" if over else "-",
                f"{(med[key] - med[floor]) * 1e3:.3f}" if floor else "-",
            ]
        )
    print()
    print_table(headers, rows)
    print(f"\nload average {min(loads):.1f} to {max(loads):.1f} during the jobs\n")
    print(markdown_table(headers, rows))
    if args.json:
        write_json(
            args.json,
            {
                "commit": git_head(ROOT, ("src", "benchmarks")),
                "machine": machine_info(),
                "args": vars(args),
                "loads": loads,
                "table": [dict(zip(headers, r, strict=True)) for r in rows],
                # (µs, comma-separated: tens of thousands of rounds, one number a line otherwise)
                "times_us": {k: ",".join(f"{t * 1e6:.1f}" for t in v) for k, v in times.items()},
                "cpu_us": {k: ",".join(f"{t * 1e6:.1f}" for t in v) for k, v in cpu.items()},
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
