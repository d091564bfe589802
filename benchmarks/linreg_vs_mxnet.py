#!/usr/bin/env python
"""MXNet's linear-regression example on hetps against MXNet 1.9.1: samples/s per worker.

    .venv/bin/python benchmarks/linreg_vs_mxnet.py [--num-samples N] [--repeats R] [--json FILE]

Both systems train the same job, 2 workers and 1 server on this machine, ``dist_sync``:
f(x) = 5x + 2 on x = 0.001 * i (i < ``--num-samples``, MXNet's ``np.arange(1000, step=0.001)``
at the default 1e6), each worker on its own half, the MLP FC 256 -> 64 -> 1, plain SGD at 1e-9
on the server, one epoch, at each batch size (``--batch-sizes``, default 100 and 16384).

* hetps: ``hetps launch -n 2 -s 1 -- python examples/linear_regression.py --data arange
  --num-samples N --batch-size B --epochs 1 --lr 1e-9 --momentum 0 --frequent F``.
* MXNet: ``benchmarks/_linreg_mx.py`` (the reference peer's ``linreg_mx.py`` with
  ``--num-samples``) under MXNet's python (``--mxnet-python``, default ``mxpeer-venv/bin/python``
  at the repository root), every role started as MXNet's ``tools/launch.py --launcher local``
  does. Without that python the MXNet half is skipped, and the output says so.

Both print a Speedometer line (``Speed: N samples/sec``) every F batches (``--frequent``;
default: 20, fewer when a worker has under 160 batches, so that every run prints several). The
figure of a run: per worker, the median over its lines after the first ``--warmup-lines``
(default 1: the first covers start-up); then the median over the workers. Runs alternate
(hetps, MXNet, hetps, ...; the order flips every repeat), ``--repeats`` times per batch size;
the table gives every repeat and the medians, with the ratio hetps / MXNet (1.0: as fast).

Threads (``--variants``): ``auto`` is hetps as ``hetps launch`` now runs it, no
``OMP_NUM_THREADS`` set, so the launcher gives each worker cores // processes (at least 1) and
the server and scheduler 1; ``all`` sets ``OMP_NUM_THREADS`` = every core for every process,
what every process used before (torch's and OpenBLAS's default). MXNet runs with its own
defaults (no thread variable set), as an MXNet user runs it.

Local (``--skip-local`` leaves it out): each system also trains alone, one process with its
store ``local`` (no scheduler, no server, no sockets), on a worker's share of the samples, at
the threads its workers get in the distributed run (hetps: the first variant's share; MXNet:
its own default). ``dist/local`` is then a worker's distributed speed over its speed alone:
what the parameter server, and sharing the machine with the other worker, cost each system.
The local columns also show where the hetps/MXNet ratio comes from when the compute itself is
what differs (torch against MXNet's kernels).

``--max-batches M`` caps each worker at M batches per batch size by giving both systems
min(N, M x B x workers) samples (the same data on both sides). MXNet pads a last partial batch
(one more batch than hetps, which drops it); the speed lines are unaffected.
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
    fmt,
    free_port,
    git_head,
    machine_info,
    markdown_table,
    median,
    print_table,
    run_group,
    write_json,
)

EXAMPLE = os.path.join(ROOT, "examples", "linear_regression.py")
MX_SCRIPT = os.path.join(HERE, "_linreg_mx.py")
DEFAULT_MX_PY = os.path.join(ROOT, "mxpeer-venv", "bin", "python")
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
#: a Speedometer line of either system, after the launcher's ``[worker 0]``/``[worker0]``
SPEED = re.compile(r"^\[worker ?(\d+)\].*\bSpeed: ([0-9.]+) samples/sec")
LR = 1e-9  # MXNet's example's learning rate (so x up to 1000 does not diverge)


def log(text: str) -> None:
    """Progress line on stderr (the table goes to stdout)."""
    print(f"[linreg-bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def base_env() -> dict[str, str]:
    """This environment without cluster or thread variables (each run adds its own)."""
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("DMLC_") or k in THREAD_VARS or k == "PORT":
            env.pop(k)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def parse_speeds(lines: list[str], warmup: int) -> dict:
    """Per worker: every Speedometer figure, and the median after the first ``warmup``."""
    by_worker: dict[int, list[float]] = {}
    for ln in lines:
        m = SPEED.search(ln)
        if m:
            by_worker.setdefault(int(m.group(1)), []).append(float(m.group(2)))
    per_worker = {w: median(v[warmup:]) for w, v in sorted(by_worker.items())}
    return {
        "lines": {str(w): v for w, v in sorted(by_worker.items())},
        "per_worker": {str(w): s for w, s in per_worker.items()},
        "samples_per_s": median(s for s in per_worker.values() if s is not None),
    }


def run_hetps(args, batch: int, samples: int, frequent: int, variant: str) -> dict:
    env = base_env()
    src = os.path.join(ROOT, "src")  # the hetps of this checkout
    env["PYTHONPATH"] = os.pathsep.join(
        [src] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    )
    if variant == "all":
        env["OMP_NUM_THREADS"] = str(cores())
    py = sys.executable
    argv = [py, "-m", "hetps.cli", "launch", "-n", str(args.workers), "-s", str(args.servers)]
    argv += ["--", py, EXAMPLE, "--data", "arange", "--num-samples", str(samples)]
    argv += ["--batch-size", str(batch), "--epochs", "1", "--lr", f"{LR:g}", "--momentum", "0"]
    argv += ["--frequent", str(frequent), "--log-dir", "none"]  # the store's speed, not the logs'
    t0 = time.time()
    rc, lines = run_group([("launch", argv, env)], args.job_timeout)
    wall = time.time() - t0
    # the launcher prefixes its children's lines: "[launch] [worker 0] Worker[0] ..."
    lines = [ln.split("] ", 1)[1] if ln.startswith("[launch] ") else ln for ln in lines]
    return _job("hetps", variant, batch, samples, frequent, rc, wall, lines, args)


def run_mxnet(args, batch: int, samples: int, frequent: int) -> dict:
    env = base_env()
    port = free_port()
    env.update(
        DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_PS_ROOT_PORT=str(port),
        DMLC_NODE_HOST="127.0.0.1",
        DMLC_NUM_SERVER=str(args.servers),
        DMLC_NUM_WORKER=str(args.workers),
        PS_VERBOSE="0",
        LAUNCH_T0=repr(time.time()),
    )
    argv = [args.mxnet_python, MX_SCRIPT, "--num-samples", str(samples)]
    argv += ["--batch-size", str(batch), "--epochs", "1", "--lr", f"{LR:g}"]
    argv += ["--frequent", str(frequent)]
    names = ["scheduler"] + [f"server{i}" for i in range(args.servers)]
    names += [f"worker{i}" for i in range(args.workers)]
    procs = [(n, argv, {**env, "DMLC_ROLE": n.rstrip("0123456789")}) for n in names]
    t0 = time.time()
    rc, lines = run_group(procs, args.job_timeout)
    wall = time.time() - t0
    return _job("mxnet", "default", batch, samples, frequent, rc, wall, lines, args)


def run_local(args, system: str, batch: int, samples: int, frequent: int, threads: int) -> dict:
    """One process of ``system`` with a local store on a worker's share of the samples."""
    env = base_env()
    share = samples // args.workers
    if system == "hetps":
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(ROOT, "src")] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
        )
        env["OMP_NUM_THREADS"] = str(threads)  # what the launcher gives each worker
        argv = [sys.executable, EXAMPLE, "--kv-store", "local", "--data", "arange"]
        argv += ["--momentum", "0", "--log-dir", "none"]
    else:  # MXNet's own thread default, as in its distributed run
        argv = [args.mxnet_python, MX_SCRIPT, "--kvstore", "local", "--no-shard"]
    argv += ["--num-samples", str(share), "--batch-size", str(batch), "--epochs", "1"]
    argv += ["--lr", f"{LR:g}", "--frequent", str(frequent)]
    t0 = time.time()
    rc, lines = run_group([("worker0", argv, env)], args.job_timeout)
    return _job(system, "local", batch, samples, frequent, rc, time.time() - t0, lines, args)


def _job(system, variant, batch, samples, frequent, rc, wall, lines, args) -> dict:
    job = {
        "system": system,
        "variant": variant,
        "batch_size": batch,
        "num_samples": samples,
        "frequent": frequent,
        "rc": rc,
        "wall_s": round(wall, 2),
        **parse_speeds(lines, args.warmup_lines),
    }
    if args.verbose:
        print("\n".join(lines), file=sys.stderr, flush=True)
    if rc != 0 or job["samples_per_s"] is None:
        job["error"] = f"exit code {rc}, {sum(len(v) for v in job['lines'].values())} speed lines"
        job["log_tail"] = lines[-40:]
        log(f"{system} ({variant}) batch {batch} failed: {job['error']}\n" + "\n".join(lines[-40:]))
    else:
        log(
            f"{system} ({variant}) batch {batch}: {job['samples_per_s']:.0f} samples/s per worker "
            f"({wall:.1f} s)"
        )
    return job


def auto_frequent(samples: int, batch: int, workers: int) -> int:
    """20, or fewer so that a worker with few batches still prints about 8 lines."""
    batches = (samples // workers) // batch
    return max(1, min(20, batches // 8))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[100, 16384])
    p.add_argument("--num-samples", type=int, default=1_000_000, help="MXNet's example: 1e6")
    p.add_argument("--max-batches", type=int, default=0, help="per worker (0: the whole epoch)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--frequent", type=int, default=0, help="batches per speed line (0: auto)")
    p.add_argument("--warmup-lines", type=int, default=1)
    p.add_argument(
        "--variants",
        nargs="+",
        choices=["auto", "all"],
        default=["auto", "all"],
        help="hetps thread settings: auto (the launcher's share), all (OMP_NUM_THREADS=cores)",
    )
    p.add_argument("--mxnet-python", default=DEFAULT_MX_PY)
    p.add_argument("--skip-mxnet", action="store_true")
    p.add_argument("--skip-local", action="store_true", help="no single-process baselines")
    p.add_argument("--job-timeout", type=float, default=900.0)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", action="store_true", help="also print the tables in Markdown")
    p.add_argument("--verbose", action="store_true", help="echo every job's output")
    args = p.parse_args(argv)

    mx_reason = None
    if args.skip_mxnet:
        mx_reason = "skipped (--skip-mxnet)"
    elif not os.path.exists(args.mxnet_python):
        mx_reason = f"not run: no MXNet python at {args.mxnet_python} (see --mxnet-python)"
    if mx_reason:
        print(f"MXNet half: {mx_reason}; hetps side only", flush=True)

    from hetps.launch.contract import thread_share

    n_cores = cores()
    procs = 1 + args.servers + args.workers
    threads = {
        "auto": {
            "worker": thread_share("worker", n_cores, procs),
            "server": thread_share("server", n_cores, procs),
            "scheduler": thread_share("scheduler", n_cores, procs),
        },
        "all": {"worker": n_cores, "server": n_cores, "scheduler": n_cores},
    }
    info = machine_info()
    info["affinity_cores"] = n_cores
    info["commit"] = git_head(ROOT, ("src", "examples", "benchmarks"))
    log(
        f"{info['cpu']}, {n_cores} cores, load {info['loadavg']}, commit {info['commit']}; "
        f"threads auto = {threads['auto']}"
    )

    jobs: list[dict] = []
    for rep in range(args.repeats):
        for batch in args.batch_sizes:
            samples = args.num_samples
            if args.max_batches:
                samples = min(samples, args.max_batches * batch * args.workers)
            frequent = args.frequent or auto_frequent(samples, batch, args.workers)
            batches = (samples // args.workers) // batch
            if batches // frequent <= args.warmup_lines:
                if rep == 0:
                    print(
                        f"batch {batch}: not run: a worker gets {batches} batch(es) of "
                        f"{samples // args.workers} samples, too few for a speed line after "
                        f"{args.warmup_lines} warm-up line(s) at one line per {frequent} "
                        "batch(es): raise --num-samples (or --max-batches)",
                        flush=True,
                    )
                continue
            order: list[tuple[str, str]] = []
            for i, v in enumerate(args.variants):
                order.append(("hetps", v))
                if i == 0 and not mx_reason:
                    order.append(("mxnet", "default"))
            if not args.skip_local:
                order.append(("hetps", "local"))
                if not mx_reason:
                    order.append(("mxnet", "local"))
            if rep % 2:
                order.reverse()
            for system, variant in order:
                log(f"repeat {rep + 1}/{args.repeats}, batch {batch}: {system} ({variant})")
                if variant == "local":
                    job = run_local(
                        args, system, batch, samples, frequent, threads[args.variants[0]]["worker"]
                    )
                elif system == "hetps":
                    job = run_hetps(args, batch, samples, frequent, variant)
                else:
                    job = run_mxnet(args, batch, samples, frequent)
                job["repeat"] = rep
                jobs.append(job)

    def speed(system: str, variant: str, batch: int, rep: int | None = None):
        vals = [
            j["samples_per_s"]
            for j in jobs
            if j["system"] == system
            and j["variant"] == variant
            and j["batch_size"] == batch
            and (rep is None or j["repeat"] == rep)
        ]
        return median(vals)

    def ratio(a, b):
        return a / b if a and b else None

    main_v = args.variants[0]
    other = [v for v in args.variants[1:]]
    headers = ["batch", "repeat", f"hetps ({main_v})", "MXNet", "hetps/MXNet"]
    for v in other:
        headers += [f"hetps ({v})", f"{main_v}/{v}"]
    local = not args.skip_local
    if local:
        headers += [
            "hetps local",
            "MXNet local",
            "local h/M",
            "hetps dist/local",
            "MXNet dist/local",
        ]
    rows, summary = [], {}
    for batch in args.batch_sizes:
        if not any(j["batch_size"] == batch for j in jobs):
            summary[str(batch)] = {"skipped": "too few samples for a speed line"}
            continue
        for rep in [*range(args.repeats), None]:
            h = speed("hetps", main_v, batch, rep)
            m = speed("mxnet", "default", batch, rep)
            row = [batch, "median" if rep is None else rep + 1, fmt(h, ".0f"), fmt(m, ".0f")]
            r = fmt(ratio(h, m), ".3f")
            pairs = [
                ratio(speed("hetps", main_v, batch, i), speed("mxnet", "default", batch, i))
                for i in range(args.repeats)
            ]
            pairs = [x for x in pairs if x is not None]
            if rep is None and len(pairs) > 1:  # the ratio of the medians, and the pairs' range
                r += f" ({min(pairs):.2f}-{max(pairs):.2f})"
            row.append(r)
            for v in other:
                o = speed("hetps", v, batch, rep)
                row += [fmt(o, ".0f"), fmt(ratio(h, o), ".3f")]
            if local:
                hl, ml = speed("hetps", "local", batch, rep), speed("mxnet", "local", batch, rep)
                row += [fmt(hl, ".0f"), fmt(ml, ".0f"), fmt(ratio(hl, ml), ".3f")]
                row += [fmt(ratio(h, hl), ".3f"), fmt(ratio(m, ml), ".3f")]
            rows.append(row)
        per_rep = [
            ratio(speed("hetps", main_v, batch, i), speed("mxnet", "default", batch, i))
            for i in range(args.repeats)
        ]
        summary[str(batch)] = {
            "hetps": {v: speed("hetps", v, batch) for v in args.variants},
            "mxnet": speed("mxnet", "default", batch),
            "ratio_hetps_over_mxnet": ratio(
                speed("hetps", main_v, batch), speed("mxnet", "default", batch)
            ),
            "ratio_per_repeat": per_rep,
            **(
                {
                    "hetps_local": speed("hetps", "local", batch),
                    "mxnet_local": speed("mxnet", "local", batch),
                    "hetps_dist_over_local": ratio(
                        speed("hetps", main_v, batch), speed("hetps", "local", batch)
                    ),
                    "mxnet_dist_over_local": ratio(
                        speed("mxnet", "default", batch), speed("mxnet", "local", batch)
                    ),
                }
                if local
                else {}
            ),
            **{
                f"ratio_{main_v}_over_{v}": ratio(
                    speed("hetps", main_v, batch), speed("hetps", v, batch)
                )
                for v in other
            },
        }
    print(
        f"\nsamples/s per worker ({args.workers} workers, {args.servers} server, "
        f"{args.num_samples} samples"
        + (f", at most {args.max_batches} batches per worker" if args.max_batches else "")
        + f"; medians over lines after {args.warmup_lines} warm-up line(s), then over workers)"
    )
    if mx_reason:
        print(f"MXNet: {mx_reason}")
    print_table(headers, rows)
    if args.markdown:
        print()
        print(markdown_table(headers, rows))
    failed = [j for j in jobs if "error" in j]
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "linreg_vs_mxnet",
                "argv": sys.argv if argv is None else ["linreg_vs_mxnet.py", *argv],
                "machine": info,
                "threads": threads,
                "mxnet": mx_reason or f"mxnet 1.9.1 ({args.mxnet_python})",
                "summary": summary,
                "jobs": jobs,
            },
        )
        log(f"wrote {args.json}")
    if failed:
        log(f"{len(failed)} job(s) failed")
    return 1 if any(j["system"] == "hetps" for j in failed) else 0


if __name__ == "__main__":
    sys.exit(main())
