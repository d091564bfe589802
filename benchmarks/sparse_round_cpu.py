#!/usr/bin/env python
"""Where a row-sparse round's CPU goes: every thread of every process of a 2-worker, 2-server
``hetps launch`` job, per round, from /proc/<pid>/task/<tid>/schedstat (nanoseconds).

    .venv/bin/python benchmarks/sparse_round_cpu.py [--trees OTHER_CHECKOUT,.] [--repeats 3]
        [--rows 1000000] [--cols 16] [--frac 0.001] [--opt sgd] [--rounds 400] [--tcp]

Each worker runs the rounds of benchmarks/sparse_tables.py (push of its ids' rows, then
``row_sparse_pull`` of them); rank 0 reads every thread of the job's processes (found by
their ``BENCH_JOB`` tag) before and after the timed rounds. Jobs alternate between the trees
(``--trees``: each a checkout with its own ``.venv``), A B A B ...; per tree the table gives
the median over jobs of each thread's CPU microseconds per round, and the round's median.
Python threads carry their names (a ``sitecustomize`` on ``PYTHONPATH`` names them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

NAMER = """import ctypes, threading
_prctl, _run = ctypes.CDLL(None).prctl, threading.Thread._bootstrap_inner
def _named(self):
    _prctl(15, self.name[:15].encode(), 0, 0, 0)
    _run(self)
threading.Thread._bootstrap_inner = _named
"""


def threads(pids: dict[int, dict[str, str]]) -> dict[tuple, int]:
    """(role rank, thread name, tid) -> CPU ns so far, for every thread of ``pids``."""
    out = {}
    for pid, info in pids.items():
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ns = int(f.read().split()[0])
            except OSError:
                continue
            if int(tid) == pid:
                name = "main"
            out[(f"{info['role']}{info['rank']}", name, tid)] = ns
    return out


def worker(rows: int, cols: int, frac: float, opt: str, rounds: int) -> None:
    import numpy as np
    from _common import find_tagged
    from _sparse_mx import ids_for

    import hetps.kv
    from hetps import optim
    from hetps.tables.rowsparse import Table

    kv = hetps.kv.create("dist_sync")
    kv.set_optimizer(
        optim.Adam(learning_rate=0.001) if opt == "adam" else optim.SGD(learning_rate=0.01)
    )
    kv.init(1, Table(rows, cols))
    grads = []
    for s in range(4):
        ids = ids_for(rows, frac, kv.rank, s)
        grads.append((ids, np.random.default_rng(s).standard_normal((ids.size, cols), np.float32)))
    for i in range(20):
        kv.push(1, grads[i % 4])
        kv.row_sparse_pull(1, row_ids=grads[i % 4][0])
    pids = find_tagged(os.environ["BENCH_JOB"]) if kv.rank == 0 else {}
    if kv.rank == 0:
        pids[os.getpid()] = {"role": "worker"}
    for pid, info in pids.items():  # (numbered by pid within a role; this worker is "me")
        peers = sorted(p for p in pids if pids[p]["role"] == info["role"])
        info["rank"] = "-me" if pid == os.getpid() else str(peers.index(pid))
    kv.barrier()
    before, times = threads(pids), []
    for i in range(rounds):
        t0 = time.perf_counter()
        kv.push(1, grads[i % 4])
        kv.row_sparse_pull(1, row_ids=grads[i % 4][0])
        times.append(time.perf_counter() - t0)
    after = threads(pids)
    kv.barrier()
    if kv.rank == 0:
        cpu = {" ".join(k[:2]): (after[k] - before.get(k, 0)) / rounds / 1e3 for k in after}
        print("CPUJSON " + json.dumps({"round_ms": sorted(times)[rounds // 2] * 1e3, "us": cpu}))


def main() -> int:
    from _common import median, run_group

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", default=".", help="checkouts to alternate, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--cols", type=int, default=16)
    ap.add_argument("--frac", type=float, default=0.001)
    ap.add_argument("--opt", default="sgd")
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--tcp", action="store_true", help="HETPS_SHM_BYTES=0: no rings")
    args = ap.parse_args()
    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    namer = tempfile.mkdtemp(prefix="hetps-namer-")
    with open(os.path.join(namer, "sitecustomize.py"), "w") as f:
        f.write(NAMER)
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    loads = []
    try:
        for rep in range(args.repeats):
            for tree in trees if rep % 2 == 0 else trees[::-1]:
                py = os.path.join(tree, ".venv", "bin", "python")
                env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "HETPS_"))}
                env.update(BENCH_JOB=uuid.uuid4().hex, PYTHONPATH=f"{namer}:{tree}/src")
                if args.tcp:
                    env["HETPS_SHM_BYTES"] = "0"
                argv = [py, "-m", "hetps.cli", "launch", "-n", "2", "-s", "2", "--", py]
                argv += [os.path.abspath(__file__), "--worker", str(args.rows), str(args.cols)]
                argv += [str(args.frac), args.opt, str(args.rounds)]
                loads.append(os.getloadavg()[0])
                rc, lines = run_group([("launch", argv, env)], 600)
                got = [json.loads(ln.split("CPUJSON ", 1)[1]) for ln in lines if "CPUJSON " in ln]
                if rc or not got:
                    print("\n".join(lines[-30:]))
                    raise SystemExit(f"job in {tree} failed ({rc})")
                runs[tree].append(got[0])
                print(
                    f"{tree}: round {got[0]['round_ms']:.3f} ms, load {loads[-1]:.1f}", flush=True
                )
    finally:
        shutil.rmtree(namer, ignore_errors=True)
    names = sorted({n for rs in runs.values() for r in rs for n in r["us"]})
    by_proc = {}
    print(
        f"\nCPU us per round (median of {args.repeats} jobs); load {min(loads):.1f}-{max(loads):.1f}"
    )
    print(f"{'thread':34s}" + "".join(f"{os.path.basename(t) or t:>14s}" for t in trees))
    for n in names:
        meds = [median(r["us"].get(n, 0.0) for r in runs[t]) for t in trees]
        if max(meds) >= 5:
            print(f"{n:34s}" + "".join(f"{m:14.1f}" for m in meds))
        proc = n.split()[0]
        by_proc.setdefault(proc, [0.0] * len(trees))
        by_proc[proc] = [a + m for a, m in zip(by_proc[proc], meds, strict=True)]
    for proc, tot in sorted(by_proc.items()):
        print(f"{proc + ' (all threads)':34s}" + "".join(f"{m:14.1f}" for m in tot))
    tot = [median(sum(r["us"].values()) for r in runs[t]) for t in trees]
    print(f"{'all processes':34s}" + "".join(f"{m:14.1f}" for m in tot))
    rnd = [median(r["round_ms"] for r in runs[t]) * 1e3 for t in trees]
    print(f"{'round median (us)':34s}" + "".join(f"{m:14.1f}" for m in rnd))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(
            int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], int(sys.argv[6])
        )
    else:
        sys.exit(main())
