#!/usr/bin/env python
"""Row-sparse table rounds, hetps against MXNet 1.9.1 in the same run (2 workers, 2 servers).

    .venv/bin/python benchmarks/sparse_tables.py [--rows 1000000] [--cols 16,64]
        [--fracs 0.01,0.001] [--opts sgd,adam] [--repeats 3] [--rounds 20] [--tables 1]
        [--json FILE]

A round, on each of 2 workers, ``dist_sync``: push a row-sparse gradient of its ids, then
``row_sparse_pull`` the same ids (``--fracs``: the share of the table's rows each worker
touches, distinct ids drawn per worker from a seeded generator; both systems get the same ids
and rows, prepared before the timing; a share under 16 rows is printed as its count: with
``--fracs 0.000004`` a round of 4 rows, almost no table work, each system's floor). With
``--tables K`` a round is K tables of that size (each its own ids), pushed in one call and
pulled in one call, as a model with K embedding tables does each step. The servers run SGD
(``sgd``) or lazy Adam (``adam``) on the rows touched. One job per system and optimizer holds every table (``--rows`` x each of
``--cols``, float32) in turn; per table, 3 warm-up rounds then ``--rounds`` timed ones.

Systems, alternated job by job (MXNet, hetps with shared memory, hetps without, then the
next repeat in another order), ``--repeats`` times:

* ``mxnet``: MXNet 1.9.1's ``dist_sync`` KVStore (ps-lite over ZeroMQ, its server's lazy
  updates), every role started as MXNet's ``tools/launch.py --launcher local`` does, under
  ``--mxnet-python`` (default ``mxpeer-venv/bin/python`` at the repository root), each with
  ``OMP_NUM_THREADS`` = cores // processes (at least 1), the share ``hetps launch`` gives
  each of its processes (unless the variable is set already); without that python the MXNet
  column is left out and the output says so.
* ``hetps shm``: ``hetps launch -n 2 -s 2`` as it runs by default (a fresh cluster secret:
  every connection authenticated and encrypted, the bulk arrays on shared-memory rings
  between the processes of this machine).
* ``hetps tcp``: the same with ``HETPS_SHM_BYTES=0``: no rings, every array over the
  encrypted connections and the sealed bulk channels, as between hosts.

The figure of a cell is the median of every timed round of every repeat (rank 0's clock);
the ratio is MXNet's median over hetps's (above 1: hetps is faster). ``worker CPU ms``: the
CPU time rank 0's worker process (all its threads) spent per timed round, the median of the
repeats, per system (MXNet / hetps shm / hetps tcp): a figure the load of the machine moves
much less than the clock's.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _common import (  # noqa: E402
    free_port,
    git_head,
    machine_info,
    markdown_table,
    median,
    print_table,
    run_group,
    write_json,
)

DEFAULT_MX_PY = os.path.join(ROOT, "mxpeer-venv", "bin", "python")
RESULT = re.compile(r"RESULT (\d+) ([\d.e-]+) ([\d.,e-]+)")
CPU = re.compile(r"CPU (\d+) ([\d.e-]+) ([\d.e-]+)")
TABLES = re.compile(r"TABLES (\d+) ([\d.e-]+) (\d+)")
SYSTEMS = ("mxnet", "hetps shm", "hetps tcp")


def base_env() -> dict[str, str]:
    """This environment without cluster variables (each job adds its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "HETPS_"))}
    env.pop("PORT", None)  # (ps-lite would listen on it)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def job_args(args, opt: str) -> list[str]:
    return [str(args.rows), args.cols, args.fracs, opt, str(args.rounds), str(args.tables)]


def run_hetps(args, opt: str, shm: bool) -> tuple[int, list[str]]:
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "src")] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    )
    if not shm:
        env["HETPS_SHM_BYTES"] = "0"
    argv = [sys.executable, "-m", "hetps.cli", "launch", "-n", "2", "-s", "2", "--"]
    argv += [sys.executable, os.path.join(HERE, "_sparse_hetps.py"), *job_args(args, opt)]
    return run_group([("launch", argv, env)], args.job_timeout)


def run_mxnet(args, opt: str) -> tuple[int, list[str]]:
    env = base_env()
    env.update(
        DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_PS_ROOT_PORT=str(free_port()),
        DMLC_NODE_HOST="127.0.0.1",
        DMLC_NUM_SERVER="2",
        DMLC_NUM_WORKER="2",
        PS_VERBOSE="0",
    )
    names = ["scheduler", "server0", "server1", "worker0", "worker1"]
    # each process the threads `hetps launch` gives each of its own (cores // processes, at
    # least 1): MXNet's OpenMP threads on their default (every core, each process) spin
    # against each other and the other jobs, 3-8x slower rounds on this 2-core machine
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(names))))
    argv = [args.mxnet_python, os.path.join(HERE, "_sparse_mx.py"), *job_args(args, opt)]
    procs = [(n, argv, {**env, "DMLC_ROLE": n.rstrip("0123456789")}) for n in names]
    return run_group(procs, args.job_timeout)


def share(rows: int, frac: float) -> str:
    """A cell's rows per worker: the share of the table, or the count under 16 rows (a
    round of a few rows is a round with almost no table work: the floor of a system's round)."""
    n = max(1, int(rows * frac))  # (as benchmarks/_sparse_mx.py's ids_for draws them)
    return f"{frac:.1%}" if n >= 16 else f"{n} rows"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--cols", default="16,64", help="table widths, comma-separated")
    ap.add_argument("--fracs", default="0.01,0.001", help="share of rows per worker per round")
    ap.add_argument("--opts", default="sgd,adam", help="server optimizers: sgd, adam")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds per table and job")
    ap.add_argument(
        "--tables", type=int, default=1, help="tables of each size, pushed and pulled together"
    )
    ap.add_argument("--mxnet-python", default=DEFAULT_MX_PY)
    ap.add_argument("--job-timeout", type=float, default=600)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not 1 <= args.tables <= 999:
        ap.error(f"--tables {args.tables}: give 1 to 999 tables of each size")
    have_mx = os.path.exists(args.mxnet_python)
    if not have_mx:
        print(f"MXNet left out: no python at {args.mxnet_python} (see --mxnet-python)")
    # times[(opt, system, cols, frac)] = every timed round of every repeat
    times: dict[tuple, list[float]] = {}
    cpu: dict[tuple, list[float]] = {}  # the same keys: rank 0's CPU seconds per round, per job
    loads: list[float] = []
    jobs = []
    for opt in args.opts.split(","):
        for rep in range(args.repeats):
            order = list(SYSTEMS if have_mx else SYSTEMS[1:])
            if rep % 2:
                order.reverse()
            jobs += [(opt, rep, system) for system in order]
    for opt, rep, system in jobs:
        t0 = time.time()
        loads.append(os.getloadavg()[0])
        if system == "mxnet":
            rc, lines = run_mxnet(args, opt)
        else:
            rc, lines = run_hetps(args, opt, shm=system == "hetps shm")
        found = tabled = 0
        for ln in lines:
            m = RESULT.search(ln)
            if m:
                key = (opt, system, int(m.group(1)), float(m.group(2)))
                times.setdefault(key, []).extend(float(x) for x in m.group(3).split(","))
                found += 1
            m = CPU.search(ln)
            if m:
                key = (opt, system, int(m.group(1)), float(m.group(2)))
                cpu.setdefault(key, []).append(float(m.group(3)))
            m = TABLES.search(ln)
            if m and int(m.group(3)) != args.tables:  # (what the worker pushed and pulled)
                raise SystemExit(
                    f"sparse_tables: the {system} job pulled back {m.group(3)} tables a round, not "
                    f"{args.tables}"
                )
            tabled += bool(m)
        print(f"{opt} repeat {rep} {system}: {time.time() - t0:.1f} s, load {loads[-1]:.1f}")
        if rc != 0 or not found:
            print("\n".join(lines[-40:]))
            raise SystemExit(f"sparse_tables: the {system} job failed (exit code {rc})")
        if tabled != found:
            print("\n".join(lines[-40:]))
            raise SystemExit(
                f"sparse_tables: the {system} job did not say how many tables it pulled back "
                "(no TABLES line for every RESULT)"
            )
    headers = ["optimizer", "table", "rows/worker"]
    headers += [f"{s} ms" for s in (SYSTEMS if have_mx else SYSTEMS[1:])]
    if have_mx:
        headers += ["MXNet/shm", "MXNet/tcp"]
    headers.append("worker CPU ms")
    rows = []
    for opt in args.opts.split(","):
        for cols in [int(c) for c in args.cols.split(",")]:
            for frac in [float(f) for f in args.fracs.split(",")]:
                med = {s: median(times.get((opt, s, cols, frac), [])) for s in SYSTEMS}
                table = f"{args.rows / 1e6:g}M x {cols}"
                if args.tables > 1:
                    table = f"{args.tables} x {table}"
                row = [opt, table, share(args.rows, frac)]
                row += [f"{med[s] * 1e3:.2f}" for s in SYSTEMS if med[s] is not None]
                if have_mx:
                    row += [f"{med['mxnet'] / med[s]:.2f}x" for s in ("hetps shm", "hetps tcp")]
                used = [median(cpu.get((opt, s, cols, frac), [])) for s in SYSTEMS]
                row.append(" / ".join(f"{u * 1e3:.2f}" for u in used if u is not None))
                rows.append(row)
    print()
    print_table(headers, rows)
    load = f"load average {min(loads):.1f} to {max(loads):.1f} during the jobs"
    print(f"\n{load}; medians of {args.repeats} x {args.rounds} rounds per cell\n")
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
                "times": {" ".join(map(str, k)): v for k, v in times.items()},
                "cpu": {" ".join(map(str, k)): v for k, v in cpu.items()},
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
