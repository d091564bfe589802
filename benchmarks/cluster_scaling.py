"""How a dist_sync round's time grows with the number of workers and servers (issue 20).

    PYTHONPATH=src .venv/bin/python benchmarks/cluster_scaling.py \\
        [--workers 1 2 4 8] [--servers 1 2] [--repeats 3] [--rounds 200] [--json FILE]

The model is fixed while the cluster grows. By default it is the 6 keys of MXNet's
linear-regression MLP (FC 256 -> 64 -> 1: shapes (256,1), (256,), (64,256), (64,), (1,64),
(1,); 17,025 floats, 67 KiB), each key whole on one server; ``--model-mb X`` replaces it by one
float32 key of X MiB, split evenly over the servers when it has at least
``HETPS_BIGARRAY_BOUND`` elements (hetps' default, 1,000,000 = 3.8 MiB, unless
``--bigarray-bound`` says otherwise).

For every (workers W, servers S) and repeat, one ``hetps launch -n W -s S`` (``python -m
hetps.cli launch``, 127.0.0.1, the launcher's defaults: CurveZMQ, shared memory, its thread
share) runs a worker script that does ``--warmup`` untimed rounds, then ``--rounds`` timed
rounds of ``kv.push(keys, grads); kv.pull(keys, out=params)`` (``dist_sync``, no optimizer: the
servers keep the sum of the round's pushes), checks the last pulled value (W x the gradient)
and prints the median of its per-round times. A barrier separates the warm-up from the timed
rounds.

* **round ms** of a run: the mean over its workers of each worker's median round (in
  ``dist_sync`` every worker waits for the slowest, so they agree closely); over the repeats,
  the median (the JSON keeps every run and every worker).
* **x W=1**: round ms / round ms with one worker and the same number of servers.
* **cores busy**: the CPU time (user + system, from /proc) of every process of the run
  (workers, servers, scheduler, the launcher; every thread) over worker 0's timed rounds,
  divided by their wall time: close to the machine's core count means the run is CPU-bound.
  **CPU ms/round**: that CPU time per round, the cluster's whole cost of one round whatever
  the core count. Both are medians over the repeats; /proc counts in clock ticks (10 ms), so
  short runs give coarse figures.

The runs are interleaved: each repeat runs every (S, W), and the order flips every repeat.
Every run has a wall-clock limit (``--timeout``); a run that passes it is stopped (the
launcher first, with SIGTERM, then every process it started, found by a tag in its
environment, with SIGKILL), and so is anything a finished run left behind.

A run is W + S + 1 processes (the scheduler), each with a receive thread and a ZeroMQ I/O
thread; when that is more than the machine's cores the figures measure CPU sharing as much as
the protocol, and the output says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fmt, machine_info, median, print_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

#: MXNet's linear-regression example's parameters (examples/linear_regression.py).
LINREG_SHAPES = [(256, 1), (256,), (64, 256), (64,), (1, 64), (1,)]

WORKER_SCRIPT = r"""
import json, os, statistics, sys, time
import numpy as np
import hetps.kv

cfg = json.loads(os.environ["BENCH_CFG"])
kv = hetps.kv.create("dist_sync")  # a server or the scheduler serves here and exits
shapes = [tuple(s) for s in cfg["shapes"]]
keys = list(range(len(shapes)))
params = [np.zeros(s, np.float32) for s in shapes]
grads = [np.full(s, 0.5, np.float32) for s in shapes]
kv.init(keys, params)


def cluster_cpu():  # CPU seconds (user + system) of every process of this run, by role
    tag, by_role = ("BENCH_JOB=" + os.environ["BENCH_JOB"]).encode(), {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
            if tag not in env:
                continue
            role = next((e[10:].decode() for e in env if e.startswith(b"DMLC_ROLE=")), "launcher")
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks = int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, ValueError, IndexError):
            continue
        by_role[role] = by_role.get(role, 0.0) + ticks / os.sysconf("SC_CLK_TCK")
    return by_role


for _ in range(cfg["warmup"]):
    kv.push(keys, grads)
    kv.pull(keys, out=params)
kv.barrier()
if kv.rank == 0:
    cpu0, wall0 = cluster_cpu(), time.perf_counter()
times = []
for _ in range(cfg["rounds"]):
    t = time.perf_counter()
    kv.push(keys, grads)
    kv.pull(keys, out=params)
    times.append(time.perf_counter() - t)
if kv.rank == 0:
    wall = time.perf_counter() - wall0
    cpu1 = cluster_cpu()
    cpu_by_role = {r: cpu1[r] - cpu0.get(r, 0.0) for r in cpu1}
want = 0.5 * kv.num_workers
ok = all(float(p.reshape(-1)[0]) == want and float(p.reshape(-1)[-1]) == want for p in params)
res = {
    "rank": kv.rank,
    "num_workers": kv.num_workers,
    "median_s": statistics.median(times),
    "min_s": min(times),
    "p90_s": sorted(times)[int(0.9 * (len(times) - 1))],
    "value_ok": ok,
}
if kv.rank == 0:  # the whole cluster's CPU over the timed rounds (rank 0's clock)
    res.update(
        timed_wall_s=wall, cluster_cpu_s=sum(cpu_by_role.values()), cpu_s_by_role=cpu_by_role
    )
print("CLUSTER-SCALING " + json.dumps(res), flush=True)
kv.barrier()
if not ok:
    sys.exit(3)
"""

RESULT = re.compile(r"CLUSTER-SCALING (\{.*\})")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def tagged_pids(tag: str) -> list[int]:
    """Processes whose environment has ``BENCH_JOB=tag`` (this run's launcher's children)."""
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"BENCH_JOB={tag}".encode() in env:
            found.append(int(name))
    return found


def stop_run(proc: subprocess.Popen, tag: str) -> list[int]:
    """Stop a run: the launcher (SIGTERM, which stops its children, then SIGKILL), then every
    process still tagged with the run's tag. Returns the pids that had to be killed."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(timeout=5)
    killed = []
    for pid in tagged_pids(tag):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def child_env(tag: str, cfg: dict, bigarray_bound: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PORT", None)
    for k in list(env):
        if k.startswith("DMLC_"):
            env.pop(k)
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["BENCH_JOB"] = tag
    env["BENCH_CFG"] = json.dumps(cfg)
    if bigarray_bound is not None:
        env["HETPS_BIGARRAY_BOUND"] = str(bigarray_bound)
    return env


def run_one(script: Path, workers: int, servers: int, cfg: dict, args) -> dict:
    """One ``hetps launch -n W -s S`` of the worker script."""
    tag = uuid.uuid4().hex[:12]
    cmd = [
        sys.executable,
        "-m",
        "hetps.cli",
        "launch",
        "-n",
        str(workers),
        "-s",
        str(servers),
        "--",
        sys.executable,
        str(script),
    ]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        env=child_env(tag, cfg, args.bigarray_bound),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    timed_out = False
    try:
        text, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        stop_run(proc, tag)
        text, _ = proc.communicate()
    wall = time.monotonic() - t0
    leftovers = stop_run(proc, tag)
    results = sorted(
        (json.loads(m.group(1)) for m in RESULT.finditer(text or "")), key=lambda r: r["rank"]
    )
    run = {
        "workers": workers,
        "servers": servers,
        "rc": proc.returncode,
        "timed_out": timed_out,
        "wall_s": round(wall, 3),
        "results": results,
        "round_s": None,
    }
    if leftovers:
        run["killed_leftovers"] = leftovers
    errors = []
    if timed_out:
        errors.append(f"timed out after {args.timeout:g} s")
    if proc.returncode != 0:
        errors.append(f"exit code {proc.returncode}")
    if len(results) != workers:
        errors.append(f"{len(results)} of {workers} results")
    if any(not r["value_ok"] for r in results):
        errors.append("a pulled value was wrong")
    if errors:
        run["error"] = "; ".join(errors)
        run["log_tail"] = (text or "").splitlines()[-40:]
        log(f"run W={workers} S={servers} failed: {run['error']}\n" + "\n".join(run["log_tail"]))
    else:
        run["round_s"] = sum(r["median_s"] for r in results) / len(results)
        r0 = results[0]
        if r0.get("timed_wall_s"):
            run["cores_busy"] = r0["cluster_cpu_s"] / r0["timed_wall_s"]
            run["cpu_s_per_round"] = r0["cluster_cpu_s"] / cfg["rounds"]
            run["cpu_s_per_round_by_role"] = {
                k: v / cfg["rounds"] for k, v in r0["cpu_s_by_role"].items()
            }
    return run


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--servers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=200, help="timed rounds per run")
    p.add_argument("--warmup", type=int, default=20, help="untimed rounds first")
    p.add_argument(
        "--model-mb",
        type=float,
        default=None,
        help="one float32 key of this many MiB instead of the linear-regression MLP's 6 keys",
    )
    p.add_argument(
        "--bigarray-bound",
        type=int,
        default=None,
        help="HETPS_BIGARRAY_BOUND for the runs (default: hetps' own, 1,000,000 elements)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    if args.model_mb is not None:
        n = max(1, int(args.model_mb * 2**20 / 4))
        shapes, model = [(n,)], f"one key of {n:,} float32 ({args.model_mb:g} MiB)"
    else:
        shapes = LINREG_SHAPES
        n = sum(math.prod(s) for s in shapes)
        model = f"linear-regression MLP, 6 keys, {n:,} float32 ({n * 4 / 1024:.0f} KiB)"
    cfg = {"shapes": shapes, "rounds": args.rounds, "warmup": args.warmup}

    info = machine_info()
    cores = info["cores"] or 1
    print(
        f"cluster_scaling: {model}; dist_sync push+pull of every key per round; "
        f"{args.warmup} warm-up + {args.rounds} timed rounds; {args.repeats} repeats\n"
        f"machine: {info['cpu']}, {cores} cores, load average "
        f"{' '.join(f'{x:.2f}' for x in info['loadavg'])}",
        flush=True,
    )
    biggest = max(args.workers) + max(args.servers) + 1
    cpu_bound = biggest > cores
    if cpu_bound:
        print(
            f"note: the largest run is {biggest} processes (workers + servers + scheduler) on "
            f"{cores} cores: runs with more processes than cores (marked *) are CPU-bound, "
            f"and their growth measures CPU sharing on this machine as much as the protocol",
            flush=True,
        )

    runs: list[dict] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="cluster-scaling-") as tmp:
        script = Path(tmp) / "cluster_scaling_worker.py"
        script.write_text(textwrap.dedent(WORKER_SCRIPT))
        grid = [(w, s) for s in args.servers for w in args.workers]
        for rep in range(args.repeats):
            order = grid if rep % 2 == 0 else grid[::-1]
            for w, s in order:
                run = run_one(script, w, s, cfg, args)
                run["repeat"] = rep + 1
                runs.append(run)
                failed |= "error" in run
                shown = fmt(run["round_s"] and run["round_s"] * 1e3, ".3f")
                log(f"repeat {rep + 1}: W={w} S={s} round {shown} ms (wall {run['wall_s']:.1f} s)")

    rows, table = [], []
    for s in args.servers:
        base = None
        for w in args.workers:
            got = [r["round_s"] for r in runs if r["workers"] == w and r["servers"] == s]
            ok = [x for x in got if x is not None]
            med = median(ok)
            if w == 1:
                base = med
            growth = med / base if med is not None and base else None
            mine = [r for r in runs if r["workers"] == w and r["servers"] == s]
            busy = median(r.get("cores_busy") for r in mine)
            cpu = median(r.get("cpu_s_per_round") for r in mine)
            rows.append(
                {
                    "workers": w,
                    "servers": s,
                    "processes": w + s + 1,
                    "round_s": med,
                    "round_s_runs": got,
                    "growth_vs_w1": growth,
                    "cores_busy": busy,
                    "cpu_s_per_round": cpu,
                    "cpu_bound": w + s + 1 > cores,
                }
            )
            table.append(
                [
                    w,
                    s,
                    f"{w + s + 1}{'*' if w + s + 1 > cores else ''}",
                    fmt(med and med * 1e3, ".3f"),
                    (f"{min(ok) * 1e3:.3f}-{max(ok) * 1e3:.3f}" if ok else "-"),
                    fmt(growth, ".2f"),
                    fmt(busy, ".2f"),
                    fmt(cpu and cpu * 1e3, ".2f"),
                ]
            )
    print()
    text = print_table(
        [
            "workers",
            "servers",
            "processes",
            "round ms",
            "range ms",
            "x W=1",
            "cores busy",
            "CPU ms/round",
        ],
        table,
    )
    if cpu_bound:
        print(f"* more processes than the machine's {cores} cores: CPU-bound")
    end_load = os.getloadavg()
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in end_load)}")
    if args.json:
        write_json(
            str(args.json),
            {
                "benchmark": "cluster_scaling",
                "machine": info,
                "loadavg_end": end_load,
                "model": model,
                "shapes": shapes,
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "cpu_bound_note": cpu_bound,
                "rows": rows,
                "runs": runs,
                "table": text,
            },
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
