#!/usr/bin/env python
"""ESync against SSGD, ASGD and DC-ASGD on an emulated heterogeneous cluster (Fashion-MNIST).

    .venv/bin/python benchmarks/esync_vs_ssgd.py [--json FILE]            # full, ~11-12 min
    .venv/bin/python benchmarks/esync_vs_ssgd.py --quick [--json FILE]    # ~2.5-3 min
    .venv/bin/python benchmarks/esync_vs_ssgd.py --tune [--json FILE]     # the learning-rate grid
    .venv/bin/python benchmarks/esync_vs_ssgd.py --modes esync,sync --repeats 3 --budget 80

The cluster is shaped like the ESync paper's: 6 workers, 4 fast devices and 2 devices slowed
down 8x (``--slowdown 1,1,1,1,8,8``), 1 server, all on this machine. The slowdown is
*emulated*: a slowed worker sleeps (f-1)x its real compute time after every step (see ``hetps
train --help``); every process shares the same CPU cores. Every mode trains the same model
(LeNet by default) on the same real Fashion-MNIST data (i.i.d. shards by worker rank) with
the same batch size, seed, test subset and time budget:

* ``esync``  -- ESync (``-m esync``): local steps at ``-ll`` until the state server says
  ready, then w <- w_round + ``-gl`` * mean(delta);
* ``sync``   -- SSGD (``-m sync``): averaged gradients, SGD on the workers;
* ``async``  -- ASGD (``-m async``): SGD on the server;
* ``dcasgd`` -- DC-ASGD (``-m async -dcasgd 1``): delay-compensated SGD on the server;
* ``local``  -- one device, no servers, no slowdown: the accuracy reference.

Time to accuracy ``a`` is the ``t`` of rank 0's first evaluation with test accuracy >= a, in
seconds since every worker passed the start barrier (process start-up, torch import and data
loading are not counted; ``wall_s`` - budget is that start-up). Rank 0 evaluates every
``EVAL_EVERY[mode]`` of its rounds, chosen so that evaluations come every ~2.5 s in every mode
(the evaluation time is inside the measured time, as in ESync's logs). Final accuracy is the
last evaluation (at the end of the budget) and, less noisy, the mean of the last three; the
comparison with ``local`` uses the mean of the last three.

The speedup is SSGD's time to 0.8 / ESync's time to 0.8 (with ``--repeats N``, of the
medians over the N interleaved runs of each mode). After the runs the script calls ``hetps
summary`` and ``hetps plot`` on the log directory (LOGDIR/full, LOGDIR/quick or LOGDIR/tune,
emptied first) and writes the figures to ``--figures`` (default docs/figures/esync for the
full preset, LOGDIR/figures otherwise). ``--analyze-only`` re-reads the logs of an earlier
run with the same flags (no training).

``--tune`` runs the same learning-rate grid for every mode (three values, a factor 2 apart,
plus one value beyond the edge when the best value is at an edge) with a 45 s budget and
picks, per mode, the value that reaches 0.8 first (highest last-3 accuracy when none does;
highest last-3 accuracy for ``local``). The chosen values are the defaults in ``LR`` below
(docs/ESYNC.md, "Learning rates", lists the grid's results).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _common import (  # noqa: E402
    PINNED_THREADS,
    fmt,
    git_head,
    machine_info,
    markdown_table,
    mean,
    median,
    print_table,
    write_json,
)

WORKERS = 6
FIGURES_DIR = os.path.join(ROOT, "docs", "figures", "esync")
SLOWDOWN = "1,1,1,1,8,8"
THRESHOLDS = (0.7, 0.8, 0.85)

#: mode -> the `hetps train` flags that select it
MODE_FLAGS = {
    "esync": ["-m", "esync"],
    "sync": ["-m", "sync"],
    "async": ["-m", "async"],
    "dcasgd": ["-m", "async", "-dcasgd", "1"],
    "local": ["-m", "local"],
}
MODE_TITLE = {
    "esync": "ESync",
    "sync": "SSGD",
    "async": "ASGD",
    "dcasgd": "DC-ASGD",
    "local": "local (1 device)",
}

#: the learning rate each mode trains with (chosen by --tune, see docs/ESYNC.md);
#: ESync: local lr (-ll), global lr (-gl) fixed at ESync's default 1.0
LR = {"esync": 0.1, "sync": 0.1, "async": 0.1, "dcasgd": 0.05, "local": 0.05}
GLOBAL_LR = 1.0
#: the tuning grid: three values a factor 2 apart for every mode
GRID = {
    "esync": [0.05, 0.1, 0.2],
    "sync": [0.1, 0.2, 0.4],
    "async": [0.025, 0.05, 0.1],
    "dcasgd": [0.025, 0.05, 0.1],
    "local": [0.05, 0.1, 0.2],
}
#: rank 0 evaluates every N of its rounds: ~2.5 s apart on the 2-core machine in every mode
#: (a synchronous round lasts ~0.2 s, an ASGD round of a fast worker ~0.03 s, a local step ~0.01 s)
EVAL_EVERY = {"esync": 12, "sync": 12, "async": 80, "dcasgd": 80, "local": 250}

PRESETS = {
    # full: every mode, 120 s each (~11-12 minutes with start-up)
    "full": {"modes": ["esync", "sync", "async", "dcasgd", "local"], "budget": 120.0},
    # quick: ESync, SSGD and the local reference, 35 s each (under 3 minutes with start-up;
    # SSGD reaches 0.8 after 30-50 s here, so the 0.8 speedup is measured only in some quick
    # runs, the 0.7 speedup in most)
    "quick": {"modes": ["esync", "sync", "local"], "budget": 35.0},
    # tune: the grid, 45 s each
    "tune": {"modes": ["esync", "sync", "async", "dcasgd", "local"], "budget": 45.0},
}


def log(text: str) -> None:
    """Progress line on stderr (the table goes to stdout)."""
    print(f"[esync-bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- running
def train_command(mode: str, lr: float, args: argparse.Namespace, run_name: str) -> list[str]:
    """The `hetps train` command line of one run."""
    cmd = [
        sys.executable,
        "-m",
        "hetps.cli",
        "train",
        *MODE_FLAGS[mode],
        "-n",
        args.model,
        "-b",
        str(args.batch_size),
        "--time-budget",
        f"{args.budget:g}",
        "-e",
        str(args.eval_every or EVAL_EVERY[mode]),
        "--test-limit",
        str(args.test_limit),
        "-ld",
        args.logdir,
        "--run-name",
        run_name,
        "--seed",
        str(args.seed),
        "--progress",
        "lines",
    ]
    if mode == "esync":
        cmd += ["-ll", f"{lr:g}", "-gl", f"{GLOBAL_LR:g}"]
    else:
        cmd += ["-l", f"{lr:g}"]
    if mode != "local":
        cmd += ["--workers", str(WORKERS), "--servers", "1", "--slowdown", args.slowdown]
        if args.devices:
            cmd += ["--devices", args.devices]
    elif args.devices:  # the accuracy reference trains on a fast device
        cmd += ["--devices", args.devices.split(",")[fast_ranks(args)[0]]]
    return cmd


def run_one(mode: str, lr: float, args: argparse.Namespace, run_name: str) -> dict:
    """Run one training job to completion; returns its measured results."""
    cmd = train_command(mode, lr, args, run_name)
    run_dir = os.path.join(args.logdir, run_name)
    out_path = os.path.join(args.logdir, f"{run_name}.out")
    if args.analyze_only:  # the logs of an earlier run of the same command
        rc = 0 if os.path.exists(os.path.join(run_dir, "worker-0.jsonl")) else -1
        load0 = wall = None
    else:
        rc, wall, load0 = _run(cmd, run_dir, out_path, args.budget, run_name)
    res = analyze(run_dir, fast_ranks(args))
    res.update(
        {
            "mode": mode,
            "title": MODE_TITLE[mode],
            "run_name": run_name,
            "run_dir": run_dir,
            "network": args.model,
            "batch_size": args.batch_size,
            "workers": 1 if mode == "local" else WORKERS,
            "servers": 0 if mode == "local" else 1,
            "slowdown": None if mode == "local" else args.slowdown,
            "devices": args.devices,
            "learning_rate": None if mode == "esync" else lr,
            "local_lr": lr if mode == "esync" else None,
            "global_lr": GLOBAL_LR if mode == "esync" else None,
            "eval_every_rounds": args.eval_every or EVAL_EVERY[mode],
            "time_budget_s": args.budget,
            "command": "hetps " + " ".join(cmd[3:]),
            "rc": rc,
            "wall_s": wall,
            "loadavg_before": load0,
            "loadavg_after": None if args.analyze_only else os.getloadavg()[0],
        }
    )
    t08 = res["time_to_accuracy"].get("0.8")
    log(
        f"{run_name}: rc {rc}, wall {fmt(wall, '.0f')}s, t@0.8 {fmt(t08, '.1f')}s, "
        f"final {fmt(res['final_accuracy'])}"
    )
    if rc != 0 and os.path.exists(out_path):
        with open(out_path) as f:
            tail = f.read()[-3000:]
        log(f"{run_name} failed (rc {rc}); output tail:\n{tail}")
    return res


def fast_ranks(args: argparse.Namespace) -> list[int]:
    """The fast devices: with ``--devices``, the GPU workers that are not slowed down (every
    worker when none is on a GPU); else the ranks with the smallest slowdown factor."""
    f = [float(v) for v in args.slowdown.split(",")]
    if args.devices:
        gpu = [not d.strip().lower().startswith("cpu") for d in args.devices.split(",")]
        if any(gpu):
            f = [v if g else v * 1e9 for v, g in zip(f, gpu, strict=True)]
    return [i for i, v in enumerate(f) if v == min(f)]


def _run(cmd: list[str], run_dir: str, out_path: str, budget: float, run_name: str):
    """Run one `hetps train` command; (rc, wall seconds, load average before)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, **PINNED_THREADS, "PYTHONWARNINGS": "ignore"}
    load0 = os.getloadavg()[0]
    log(f"{run_name}: {' '.join(cmd[3:])}  (load {load0:.2f})")
    t0 = time.monotonic()
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=budget + 180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the job we started, by its process group
            try:
                rc = proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
            rc = rc if rc else -1
    return rc, time.monotonic() - t0, load0


# ------------------------------------------------------------------------------- analysis
def _records(path: str) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass  # a torn last line of a killed run
    except OSError:
        pass
    return out


def analyze(run_dir: str, fast: list[int]) -> dict:
    """Time to accuracy, final accuracy, throughput, local steps, from the JSONL logs."""
    ranks = {}
    if os.path.isdir(run_dir):
        for name in sorted(os.listdir(run_dir)):
            if name.startswith("worker-") and name.endswith(".jsonl"):
                ranks[int(name[len("worker-") : -len(".jsonl")])] = _records(
                    os.path.join(run_dir, name)
                )
    r0 = ranks.get(0, [])
    curve = [(float(r["t"]), float(r["accuracy"])) for r in r0 if r.get("accuracy") is not None]
    tta = {}
    for a in THRESHOLDS:
        hit = next((t for t, acc in curve if acc >= a), None)
        tta[f"{a:g}"] = hit
    wall = max((float(r["t"]) for recs in ranks.values() for r in recs), default=None)
    samples = sum(int(r["samples"]) for recs in ranks.values() for r in recs)
    fast_steps = [
        r["local_steps"] for rank, recs in ranks.items() for r in recs[5:] if rank in fast
    ]
    gaps = [b[0] - a[0] for a, b in zip(curve, curve[1:], strict=False)]
    return {
        "time_to_accuracy": tta,
        "final_accuracy": curve[-1][1] if curve else None,
        "final_accuracy_last3": mean(a for _, a in curve[-3:]) if curve else None,
        "max_accuracy": max((a for _, a in curve), default=None),
        "accuracy_curve": curve,
        "evaluations": len(curve),
        "eval_interval_s": median(gaps),
        "train_time_s": wall,
        "rounds_rank0": len(r0),
        "samples": samples,
        "throughput_samples_per_s": samples / wall if wall else None,
        "median_round_s": median(float(r["srit_s"]) for r in r0[5:] if "accuracy" not in r),
        "mean_local_steps_fast": mean(fast_steps) if fast_steps else None,
    }


#: the figures of ESync's README (accuracy, throughput, traffic, computing-time ratio) and the
#: per-iteration time; the traffic timeline is drawn separately, zoomed on a few rounds
PLOT_FIGURES = [
    "accuracy_vs_time_iid",
    "throughput",
    "traffic",
    "computing_time_ratio",
    "srit_over_iterations",
]
#: the traffic timeline's window (seconds since the run's start): a few synchronous rounds
TIMELINE_WINDOW = (30.0, 31.5)


def draw_figures(args: argparse.Namespace, single: list[dict]) -> list[str]:
    """`hetps plot` into args.figures: PLOT_FIGURES over every run, and the traffic
    timeline of the first ESync and SSGD runs over TIMELINE_WINDOW; returns the files."""
    os.makedirs(args.figures, exist_ok=True)
    only = [a for f in PLOT_FIGURES for a in ("--figure", f)]
    rc, text = hetps_tool("plot", args.logdir, "--out", args.figures, *only)
    if rc != 0:
        log(f"hetps plot not available or failed (rc {rc}): {text[-500:]}")
        return []
    written = [os.path.join(args.figures, f"{f}.png") for f in PLOT_FIGURES]
    lo, hi = TIMELINE_WINDOW
    if args.budget > hi:
        tmp = os.path.join(args.logdir, "timeline-figures")
        for mode in ("esync", "sync"):
            run = next((r for r in single if r["mode"] == mode), None)
            if run is None:
                continue
            shutil.rmtree(tmp, ignore_errors=True)
            rc, text = hetps_tool(
                "plot", args.logdir, "--out", tmp, "--figure", "traffic_timeline",
                "--run", run["run_name"], "--window", f"{lo:g},{hi:g}",
            )  # fmt: skip
            src = os.path.join(tmp, "traffic_timeline.png")
            if rc == 0 and os.path.exists(src):
                dst = os.path.join(args.figures, f"traffic_timeline_{mode}_{lo:g}-{hi:g}s.png")
                shutil.move(src, dst)
                written.append(dst)
            else:
                log(f"traffic timeline of {run['run_name']} failed (rc {rc}): {text[-300:]}")
        shutil.rmtree(tmp, ignore_errors=True)
    written = [w for w in written if os.path.exists(w)]
    log(f"figures: {', '.join(written)}")
    return written


def clean_logdir(logdir: str) -> None:
    """Create ``logdir``, removing what earlier runs of this script left there (run
    directories -- those holding a run.json -- their ``.out`` files and summary.json)."""
    os.makedirs(logdir, exist_ok=True)
    for name in os.listdir(logdir):
        path = os.path.join(logdir, name)
        if os.path.isdir(path) and os.path.exists(os.path.join(path, "run.json")):
            shutil.rmtree(path)
        elif name.endswith(".out") or name == "summary.json":
            os.remove(path)


def hetps_tool(name: str, *argv: str) -> tuple[int, str]:
    """Run `hetps summary|plot ...`; (rc, output); rc 127 when the command does not exist."""
    cmd = [sys.executable, "-m", "hetps.cli", name, *argv]
    try:
        p = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
            env={**os.environ, **PINNED_THREADS},
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, str(e)
    if p.returncode != 0 and "invalid choice" in p.stderr:
        return 127, p.stderr
    return p.returncode, p.stdout + p.stderr


# ------------------------------------------------------------------------------- reporting
def table_rows(runs: list[dict], local_acc: float | None) -> list[list[str]]:
    rows = []
    for r in runs:
        lr = (
            f"ll {r['local_lr']:g}, gl {r['global_lr']:g}"
            if r["mode"] == "esync"
            else f"{r['learning_rate']:g}"
        )
        d = (
            None
            if local_acc is None or r["final_accuracy_last3"] is None
            else 100 * (r["final_accuracy_last3"] - local_acc)
        )
        rows.append(
            [
                r["title"] + (f" (median of {r['n']})" if r.get("n", 1) > 1 else ""),
                lr,
                *(
                    fmt(r["time_to_accuracy"][f"{a:g}"], ".1f")
                    if r["time_to_accuracy"][f"{a:g}"] is not None
                    else "never"
                    for a in THRESHOLDS
                ),
                fmt(r["final_accuracy"]),
                fmt(r["final_accuracy_last3"]),
                fmt(d, "+.2f") if r["mode"] != "local" else "ref",
                fmt(r["throughput_samples_per_s"], ".0f"),
                fmt(r["median_round_s"], ".3f"),
                fmt(r["mean_local_steps_fast"], ".1f"),
            ]
        )
    return rows


HEADERS = [
    "mode",
    "lr",
    "t@0.7 s",
    "t@0.8 s",
    "t@0.85 s",
    "final acc",
    "last-3 acc",
    "vs local (pt)",
    "samples/s",
    "round s (rank 0)",
    "local steps (fast)",
]


def aggregate(reps: list[dict]) -> dict:
    """One mode's row from its repeats: medians (a threshold never reached counts as
    infinitely late, so the median is None when most repeats never reached it)."""
    if len(reps) == 1:
        return {**reps[0], "n": 1, "repeats": [reps[0]["run_name"]]}
    out = {
        k: reps[0][k]
        for k in (
            "mode",
            "title",
            "network",
            "batch_size",
            "workers",
            "servers",
            "slowdown",
            "learning_rate",
            "local_lr",
            "global_lr",
            "eval_every_rounds",
            "time_budget_s",
        )
    }
    inf = float("inf")
    tta = {}
    for a in THRESHOLDS:
        v = median(
            r["time_to_accuracy"][f"{a:g}"] if r["time_to_accuracy"][f"{a:g}"] is not None else inf
            for r in reps
        )
        tta[f"{a:g}"] = None if v is None or v == inf else v
    out["time_to_accuracy"] = tta
    out["time_to_accuracy_each"] = [r["time_to_accuracy"] for r in reps]
    for k in (
        "final_accuracy",
        "final_accuracy_last3",
        "max_accuracy",
        "eval_interval_s",
        "throughput_samples_per_s",
        "median_round_s",
        "mean_local_steps_fast",
        "wall_s",
    ):
        out[k] = median(r[k] for r in reps)
    out["final_accuracy_last3_each"] = [r["final_accuracy_last3"] for r in reps]
    out["n"] = len(reps)
    out["repeats"] = [r["run_name"] for r in reps]
    out["rc"] = max((r["rc"] for r in reps), key=abs)
    out["command"] = reps[0]["command"]
    return out


def speedup(runs: list[dict], a: str = "0.8") -> float | None:
    by = {r["mode"]: r for r in runs}
    if "esync" not in by or "sync" not in by:
        return None
    te, ts = by["esync"]["time_to_accuracy"][a], by["sync"]["time_to_accuracy"][a]
    if te is None or ts is None:
        return None
    return ts / te


def tune(args: argparse.Namespace) -> dict:
    """The learning-rate grid; returns {mode: {"trials": [...], "best": lr}}."""
    out = {}
    for mode in args.modes:
        grid = sorted(args.grid.get(mode, GRID[mode]))
        trials = [run_one(mode, lr, args, f"tune-{mode}-lr{lr:g}") for lr in grid]
        best = _best(mode, trials)
        if args.extend and len(grid) > 1 and _lr(best) in (grid[0], grid[-1]):
            # the best value is at the edge of the grid: one more value beyond it, the same
            # rule for every mode
            lr = grid[0] / 2 if _lr(best) == grid[0] else grid[-1] * 2
            grid.append(lr)
            trials.append(run_one(mode, lr, args, f"tune-{mode}-lr{lr:g}"))
            best = _best(mode, trials)
        out[mode] = {"best": _lr(best), "grid": grid, "trials": trials}
        log(
            f"tune {mode}: "
            + ", ".join(
                f"lr {_lr(t):g}: t@0.8 {fmt(t['time_to_accuracy']['0.8'], '.1f')} "
                f"acc {fmt(t['final_accuracy_last3'])}"
                for t in trials
            )
            + f" -> {_lr(best):g}"
        )
    return out


def _lr(run: dict) -> float:
    return run["local_lr"] if run["mode"] == "esync" else run["learning_rate"]


def _best(mode: str, trials: list[dict]) -> dict:
    """The trial that reaches 0.8 first (highest last-3 accuracy if none does; for local,
    the highest last-3 accuracy)."""
    if mode == "local":
        return max(trials, key=lambda r: r["final_accuracy_last3"] or 0)
    reached = [r for r in trials if r["time_to_accuracy"]["0.8"] is not None]
    if reached:
        return min(reached, key=lambda r: r["time_to_accuracy"]["0.8"])
    return max(trials, key=lambda r: r["final_accuracy_last3"] or 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="ESync, SSGD, local x 35 s (under 3 minutes)"
    )
    ap.add_argument("--tune", action="store_true", help="run the learning-rate grid instead")
    ap.add_argument("--json", default=None, help="write the results as JSON")
    ap.add_argument(
        "--figures",
        default=None,
        help="where `hetps plot` writes the PNG figures ('' for none; default: "
        "docs/figures/esync for the full preset with the default slowdown, else LOGDIR/figures)",
    )
    ap.add_argument(
        "--logdir",
        default="/tmp/hetps-bench-esync",
        help="run logs go to LOGDIR/full, LOGDIR/quick or LOGDIR/tune (emptied first)",
    )
    ap.add_argument(
        "--modes", default=None, help="comma-separated subset of " + ",".join(MODE_FLAGS)
    )
    ap.add_argument("--budget", type=float, default=None, help="seconds per run")
    ap.add_argument("-n", "--model", default="lenet")
    ap.add_argument("-b", "--batch-size", type=int, default=64)
    ap.add_argument("--test-limit", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--slowdown",
        default=SLOWDOWN,
        help=f"the workers' slowdown factors (default {SLOWDOWN}, the paper's shape)",
    )
    ap.add_argument(
        "--devices",
        default=None,
        help="each worker's device, e.g. gpu:0,gpu:0,gpu:0,gpu:0,cpu,cpu: real heterogeneous "
        "compute instead of (or with) --slowdown; give --slowdown 1,1,1,1,1,1 for none",
    )
    ap.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="rank 0 evaluates every N rounds in every mode (default: EVAL_EVERY per mode)",
    )
    ap.add_argument(
        "--analyze-only",
        action="store_true",
        help="train nothing: analyze and plot the logs an earlier run with the same flags left",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per mode (interleaved); the table shows medians",
    )
    ap.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="MODE=LR,LR,...",
        help="--tune: these values for MODE instead of GRID[MODE] (repeatable)",
    )
    ap.add_argument(
        "--no-extend",
        dest="extend",
        action="store_false",
        help="--tune: do not add a value beyond the grid's edge",
    )
    args = ap.parse_args()
    try:
        args.grid = {
            m: [float(v) for v in vals.split(",")]
            for m, _, vals in (g.partition("=") for g in args.grid)
        }
    except ValueError:
        ap.error("--grid wants MODE=LR,LR,...")

    preset_name = "tune" if args.tune else "quick" if args.quick else "full"
    preset = PRESETS[preset_name]
    args.modes_given = bool(args.modes)
    args.modes = args.modes.split(",") if args.modes else preset["modes"]
    for m in args.modes:
        if m not in MODE_FLAGS:
            ap.error(f"unknown mode {m!r}; choose from {', '.join(MODE_FLAGS)}")
    args.budget = args.budget or preset["budget"]
    try:
        if len(fast_ranks(args)) == 0 or len(args.slowdown.split(",")) != WORKERS:
            raise ValueError
    except ValueError:
        ap.error(f"--slowdown wants {WORKERS} comma-separated factors")
    if args.devices and len(args.devices.split(",")) != WORKERS:
        ap.error(f"--devices wants {WORKERS} comma-separated devices (cpu, gpu:N)")
    # one directory per preset (full, quick, tune), emptied of earlier runs first: `hetps
    # summary` and `hetps plot` read every run under it, so it holds this invocation's only
    args.logdir = os.path.join(args.logdir, preset_name)
    if not args.analyze_only:
        clean_logdir(args.logdir)
    if args.figures is None:
        full = (
            preset_name == "full"
            and args.slowdown == SLOWDOWN
            and not args.modes_given
            and not args.devices
        )
        args.figures = FIGURES_DIR if full else os.path.join(args.logdir, "figures")
    machine = machine_info()
    machine["git"] = git_head(ROOT, ("src",))
    log(f"machine: {machine['cpu']}, {machine['cores']} cores, load {machine['loadavg']}")
    t_start = time.monotonic()

    if args.tune:
        result = tune(args)
        rows = []
        for mode, t in result.items():
            for r in sorted(t["trials"], key=_lr):
                g = _lr(r)
                rows.append(
                    [
                        MODE_TITLE[mode],
                        f"{g:g}",
                        fmt(r["time_to_accuracy"]["0.7"], ".1f"),
                        fmt(r["time_to_accuracy"]["0.8"], ".1f"),
                        fmt(r["final_accuracy_last3"]),
                        "<- chosen" if g == t["best"] else "",
                    ]
                )
        headers = ["mode", "lr", "t@0.7 s", "t@0.8 s", f"acc@{args.budget:g}s (last 3)", ""]
        print()
        print_table(headers, rows)
        if args.json:
            write_json(
                args.json,
                {
                    "benchmark": "esync_vs_ssgd --tune",
                    "machine": machine,
                    "budget_s": args.budget,
                    "grid": {m: t["grid"] for m, t in result.items()},
                    "best": {m: t["best"] for m, t in result.items()},
                    "trials": {m: t["trials"] for m, t in result.items()},
                    "markdown": markdown_table(headers, rows),
                    "total_s": time.monotonic() - t_start,
                },
            )
        return 0

    single = []
    for i in range(args.repeats):
        # repeats interleaved: mode order A B C ... A B C ...
        for mode in args.modes:
            name = f"{mode}-{args.model}-w{1 if mode == 'local' else WORKERS}"
            name += f"-r{i}" if i else ""
            single.append(run_one(mode, LR[mode], args, name))
    runs = [aggregate([r for r in single if r["mode"] == m]) for m in args.modes]
    local = next((r for r in runs if r["mode"] == "local"), None)
    local_acc = local["final_accuracy_last3"] if local else None
    for r in runs:
        r["final_vs_local_pt"] = (
            None
            if local_acc is None or r["final_accuracy_last3"] is None
            else 100 * (r["final_accuracy_last3"] - local_acc)
        )
    sp = speedup(runs)
    sp_by = {a: speedup(runs, f"{a:g}") for a in THRESHOLDS}

    summary = None
    rc, text = hetps_tool(
        "summary", args.logdir, "--json", os.path.join(args.logdir, "summary.json")
    )
    if rc == 0:
        with open(os.path.join(args.logdir, "summary.json")) as f:
            summary = json.load(f)
    else:
        log(f"hetps summary not available or failed (rc {rc}); using this script's analysis")
    figures = draw_figures(args, single) if args.figures else []

    rows = table_rows(runs, local_acc)
    print()
    print(
        f"{args.model}, batch {args.batch_size}, {WORKERS} workers (slowdown {args.slowdown}, "
        f"emulated{'; devices ' + args.devices if args.devices else ''}) + 1 server; "
        f"{args.budget:g} s per run; test subset {args.test_limit}"
    )
    print_table(HEADERS, rows)
    print(
        f"speedup ESync vs SSGD (time to 0.8): {fmt(sp, '.2f')}x   "
        + "  ".join(f"(to {a:g}: {fmt(v, '.2f')}x)" for a, v in sp_by.items())
    )
    goals = {
        "esync_4x_sooner_than_ssgd_to_0.8": None if sp is None else sp >= 4.0,
        "esync_within_1pt_of_local": None
        if local_acc is None
        else next(
            (
                abs(r["final_vs_local_pt"]) <= 1.0
                for r in runs
                if r["mode"] == "esync" and r["final_vs_local_pt"] is not None
            ),
            None,
        ),
    }
    print(f"goals: {goals}")
    if args.json:
        # summaries from `hetps summary` keyed by run directory name, for cross-checking
        by_dir = {}
        for s in (summary or {}).get("runs", []):
            by_dir[os.path.basename(str(s.get("run_dir", "")))] = {
                k: s.get(k)
                for k in (
                    "time_to_accuracy",
                    "final_accuracy",
                    "throughput_samples_per_s",
                    "traffic_mb_per_s",
                    "computing_time_ratio",
                    "asrit_s",
                )
            }
        for r in runs:
            r["hetps_summary"] = [by_dir.get(name) for name in r["repeats"]]
        write_json(
            args.json,
            {
                "benchmark": "esync_vs_ssgd" + (" --quick" if args.quick else ""),
                "machine": machine,
                "setup": {
                    "model": args.model,
                    "batch_size": args.batch_size,
                    "workers": WORKERS,
                    "servers": 1,
                    "slowdown": args.slowdown,
                    "devices": args.devices,
                    "emulated_heterogeneity": any(float(v) != 1 for v in args.slowdown.split(",")),
                    "time_budget_s": args.budget,
                    "test_limit": args.test_limit,
                    "seed": args.seed,
                    "eval_every_rounds": {m: args.eval_every or EVAL_EVERY[m] for m in args.modes},
                    "omp_num_threads": 1,
                },
                "runs": runs,
                "single_runs": single if args.repeats > 1 else [],
                "speedup_esync_vs_ssgd_time_to_0.8": sp,
                "speedup_esync_vs_ssgd": {f"{a:g}": v for a, v in sp_by.items()},
                "goals": goals,
                "figures": figures,
                "markdown": markdown_table(HEADERS, rows),
                "total_s": time.monotonic() - t_start,
            },
        )
        log(f"wrote {args.json}")
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
