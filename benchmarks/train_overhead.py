#!/usr/bin/env python
"""Framework overhead of hetps training: a step with 1 worker + 1 server vs the same step local.

    .venv/bin/python benchmarks/train_overhead.py [--quick] [--json FILE] [--models mlp,lenet]

For every model, the same `hetps train` command is run alternately (A B A B ...) as

* A = ``-m local``: one process, plain ``torch.optim.SGD``, no KVStore;
* B = ``-m sync --workers 1 --servers 1``: the same model, batch, data, seed and learning
  rate, every gradient pushed to the server from a backward hook and pulled back
  (``DistributedOptimizer``), plus the per-round stop check ``hetps train`` does in sync mode.

A step's time is taken from each run's own JSONL log (rank 0):

* ``srit_s``: the whole iteration as the training loop sees it (batch, forward, backward with
  the pushes, waiting for the pulls, optimizer step, stop check, logging) -- the headline;
* ``compute_s + wait_s``: forward, backward (with the pushes issued by the hooks) and waiting
  for the pulls, the optimizer step -- without the batch slicing, the stop check and logging.

The first ``--warmup`` iterations and every iteration that evaluated are dropped; per run the
median; per model the median over the runs of each kind; ratio = B / A (1.0 = no overhead;
the goal of issue 3 is <= 1.15). The per-pair ratios show the spread. Every process runs
with BLAS/OpenMP pinned to one thread. Nothing is slowed down (no --slowdown).

With ``--overlap`` each pair also runs two server-update kinds (the ``-m async`` of 1 worker +
1 server, SGD on the server; with one worker it is the same training as sync):

* C = ``-m async``: ``step()`` waits for every parameter's new weights;
* D = ``-m async --overlap-forward``: ``step()`` returns at once and each layer's forward
  waits for its own weights (``DistributedOptimizer(overlap_forward=True)``), so the pulls of
  the last layers travel while the first layers compute.

MXNet 1.9.1 beside it (mlp and lenet; ``--skip-mxnet`` leaves it out): each pair also runs
``benchmarks/_overhead_mx.py`` under MXNet's python (``--mxnet-python``, default
``mxpeer-venv/bin/python``) on the same model (same parameter count, checked), batch, data and
rounds, alone (no KVStore) and as 1 worker + 1 server with a ``dist_sync`` KVStore (SGD on the
server), every process pinned to one thread too. Its step is the interval between
``Module.fit``'s batch callbacks (the whole iteration). ``MXNet ratio`` is MXNet's own
1w+1s / alone: what the parameter server costs MXNet on the same step.
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
    free_port,
    git_head,
    machine_info,
    markdown_table,
    median,
    print_table,
    run_group,
    write_json,
)

GOAL = 1.15
#: model -> (batch size, rounds per run); the rounds keep a run to a few seconds of steps
MODELS = {
    "mlp": (64, 400),
    "lenet": (64, 300),
    "resnet18-v1": (16, 40),
}
PRESETS = {
    "full": {"models": ["mlp", "lenet", "resnet18-v1"], "pairs": 4, "round_scale": 1.0},
    "quick": {"models": ["mlp", "lenet", "resnet18-v1"], "pairs": 2, "round_scale": 0.6},
}


MX_SCRIPT = os.path.join(HERE, "_overhead_mx.py")
DEFAULT_MX_PY = os.path.join(ROOT, "mxpeer-venv", "bin", "python")
#: the models _overhead_mx.py has, with hetps's parameter counts (checked there)
MX_MODELS = {"mlp": 269_322, "lenet": 61_706}


def log(text: str) -> None:
    print(f"[overhead {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run_one(
    kind: str, model: str, batch: int, rounds: int, args: argparse.Namespace, name: str
) -> dict:
    """One `hetps train` run (kind 'local' or 'sync'); per-iteration medians of rank 0."""
    cmd = [
        sys.executable,
        "-m",
        "hetps.cli",
        "train",
        "-m",
        kind,
        "-n",
        model,
        "-b",
        str(batch),
        "-l",
        "0.01",
        "--max-rounds",
        str(rounds),
        "-e",
        "1000000000",
        "--test-limit",
        "100",
        "--train-limit",
        str(args.train_limit),
        "-ld",
        args.logdir,
        "--run-name",
        name,
        "--seed",
        "0",
        "--progress",
        "lines",
    ]
    if kind != "local":
        cmd += ["--workers", "1", "--servers", "1"]
    if kind == "async-overlap":
        cmd[cmd.index("async-overlap")] = "async"
        cmd += ["--overlap-forward"]
    if args.gpu is not None:
        cmd += ["-g", str(args.gpu)]
    if args.data_dir:
        cmd += ["-dd", args.data_dir]
    run_dir = os.path.join(args.logdir, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, **PINNED_THREADS, "PYTHONWARNINGS": "ignore"}
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    with open(os.path.join(args.logdir, f"{name}.out"), "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the job we started, by its process group
            rc = proc.wait() or -1
    wall = time.monotonic() - t0
    recs = []
    path = os.path.join(run_dir, "worker-0.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    try:
                        recs.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
    steady = [r for r in recs[args.warmup :] if "accuracy" not in r]
    res = {
        "kind": kind,
        "model": model,
        "batch_size": batch,
        "rounds": len(recs),
        "used": len(steady),
        "rc": rc,
        "wall_s": wall,
        "loadavg_before": load0,
        "srit_s": median(r["srit_s"] for r in steady),
        "step_s": median(r["compute_s"] + r["wait_s"] for r in steady),
        "compute_s": median(r["compute_s"] for r in steady),
        "wait_s": median(r["wait_s"] for r in steady),
        "command": "hetps " + " ".join(cmd[3:]),
    }
    log(
        f"{name}: rc {rc}, {len(steady)} steps used, srit {fmt(res['srit_s'], '.5f')} s, "
        f"compute+wait {fmt(res['step_s'], '.5f')} s (load {load0:.2f})"
    )
    return res


def run_mx(kind: str, model: str, batch: int, rounds: int, args: argparse.Namespace) -> dict:
    """One MXNet run of ``model``: ``local`` (one process, no KVStore) or ``sync`` (scheduler,
    server and worker processes, ``dist_sync``); the median step of the worker."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_") and k != "PORT"}
    env.update(PINNED_THREADS, PYTHONUNBUFFERED="1")
    argv = [args.mxnet_python, MX_SCRIPT, "--model", model, "--batch-size", str(batch)]
    argv += ["--rounds", str(rounds), "--warmup", str(args.warmup), "--lr", "0.01"]
    argv += ["--train-limit", str(args.train_limit), "--expect-params", str(MX_MODELS[model])]
    if args.data_dir:
        argv += ["--data-dir", args.data_dir]
    if kind == "local":
        procs = [("worker", [*argv, "--kvstore", "none"], env)]
    else:
        env.update(
            DMLC_PS_ROOT_URI="127.0.0.1",
            DMLC_PS_ROOT_PORT=str(free_port()),
            DMLC_NODE_HOST="127.0.0.1",
            DMLC_NUM_SERVER="1",
            DMLC_NUM_WORKER="1",
        )
        procs = [
            (role, [*argv, "--kvstore", "dist_sync"], {**env, "DMLC_ROLE": role})
            for role in ("scheduler", "server", "worker")
        ]
    t0 = time.monotonic()
    rc, lines = run_group(procs, args.job_timeout)
    found = [ln for ln in lines if ln.startswith("[worker] STEP-MEDIAN ")]
    step = float(found[-1].split()[2]) if found and rc == 0 else None
    if step is None and rc == 0:
        rc = 1  # it ended without its figure
    log(f"mxnet {model}-{kind}: rc {rc}, step {fmt(step, '.5f')} s")
    if step is None:
        log("\n".join(lines[-30:]))
    return {"kind": f"mxnet-{kind}", "model": model, "rc": rc, "step_s": step,
            "wall_s": time.monotonic() - t0}  # fmt: skip


def ratio(a: float | None, b: float | None) -> float | None:
    return b / a if a and b is not None else None


def overlap_figures(runs: dict) -> dict:
    """The server-update kinds of ``--overlap``: medians and ratios to local (same run)."""
    loc = median(r["srit_s"] for r in runs["local"])
    wait = median(r["srit_s"] for r in runs["async"])
    over = median(r["srit_s"] for r in runs["async-overlap"])
    return {
        "async_srit_s": wait,
        "overlap_srit_s": over,
        "ratio_async": ratio(loc, wait),
        "ratio_overlap": ratio(loc, over),
        "overlap_vs_async": ratio(wait, over),
        "pair_ratios_overlap_vs_async": [
            ratio(a["srit_s"], b["srit_s"])
            for a, b in zip(runs["async"], runs["async-overlap"], strict=True)
        ],
        "runs": runs["async"] + runs["async-overlap"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 pairs per model, shorter runs")
    ap.add_argument("--json", default=None)
    ap.add_argument("--models", default=None, help="comma-separated, from " + ",".join(MODELS))
    ap.add_argument("--pairs", type=int, default=None, help="A/B pairs per model")
    ap.add_argument("--warmup", type=int, default=10, help="iterations dropped per run")
    ap.add_argument("--train-limit", type=int, default=8192)
    ap.add_argument(
        "--gpu",
        type=int,
        default=None,
        help="CUDA device index for both kinds (the server stays on the CPU, so every "
        "gradient crosses to host memory and back)",
    )
    ap.add_argument("--data-dir", default=None, help="Fashion-MNIST directory (-dd)")
    ap.add_argument("--logdir", default="/tmp/hetps-bench-overhead")
    ap.add_argument("--mxnet-python", default=DEFAULT_MX_PY)
    ap.add_argument("--skip-mxnet", action="store_true")
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="also run -m async with and without --overlap-forward (server-side SGD)",
    )
    ap.add_argument("--job-timeout", type=float, default=600.0, help="seconds per MXNet run")
    args = ap.parse_args()
    mx_reason = None
    if args.skip_mxnet:
        mx_reason = "skipped (--skip-mxnet)"
    elif args.gpu is not None:
        mx_reason = "not run with --gpu (its script is CPU-only)"
    elif not os.path.exists(args.mxnet_python):
        mx_reason = f"not run: no MXNet python at {args.mxnet_python} (see --mxnet-python)"
    preset = PRESETS["quick" if args.quick else "full"]
    models = args.models.split(",") if args.models else preset["models"]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    pairs = args.pairs or preset["pairs"]
    os.makedirs(args.logdir, exist_ok=True)
    machine = machine_info()
    machine["git"] = git_head(ROOT, ("src",))
    log(f"machine: {machine['cpu']}, {machine['cores']} cores, load {machine['loadavg']}")
    t_start = time.monotonic()

    results = []
    rows = []
    for model in models:
        batch, rounds = MODELS[model]
        rounds = max(args.warmup + 10, int(rounds * preset["round_scale"]))
        runs = {"local": [], "sync": [], "mxnet-local": [], "mxnet-sync": []}
        kinds = ["local", "sync"] + (["async", "async-overlap"] if args.overlap else [])
        with_mx = mx_reason is None and model in MX_MODELS
        for i in range(pairs):
            for kind in kinds:  # A B (C D) A B (C D)
                runs.setdefault(kind, []).append(
                    run_one(kind, model, batch, rounds, args, f"{model}-{kind}-{i}")
                )
            for kind in ("local", "sync") if with_mx else ():
                runs[f"mxnet-{kind}"].append(run_mx(kind, model, batch, rounds, args))
        mx_loc = median(r["step_s"] for r in runs["mxnet-local"])
        mx_syn = median(r["step_s"] for r in runs["mxnet-sync"])
        loc = {k: median(r[k] for r in runs["local"]) for k in ("srit_s", "step_s")}
        syn = {k: median(r[k] for r in runs["sync"]) for k in ("srit_s", "step_s")}
        pair_ratios = [
            ratio(a["srit_s"], b["srit_s"])
            for a, b in zip(runs["local"], runs["sync"], strict=True)
        ]
        res = {
            "model": model,
            "batch_size": batch,
            "rounds_per_run": rounds,
            "pairs": pairs,
            "local_srit_s": loc["srit_s"],
            "sync_srit_s": syn["srit_s"],
            "ratio_srit": ratio(loc["srit_s"], syn["srit_s"]),
            "local_step_s": loc["step_s"],
            "sync_step_s": syn["step_s"],
            "ratio_step": ratio(loc["step_s"], syn["step_s"]),
            "pair_ratios_srit": pair_ratios,
            "overhead_ms_srit": None
            if loc["srit_s"] is None or syn["srit_s"] is None
            else 1000 * (syn["srit_s"] - loc["srit_s"]),
            "goal_met": (ratio(loc["srit_s"], syn["srit_s"]) or 99) <= GOAL,
            "mxnet_local_step_s": mx_loc,
            "mxnet_sync_step_s": mx_syn,
            "mxnet_ratio": ratio(mx_loc, mx_syn),
            "mxnet_pair_ratios": [
                ratio(a["step_s"], b["step_s"])
                for a, b in zip(runs["mxnet-local"], runs["mxnet-sync"], strict=True)
            ],
            "runs": runs["local"] + runs["sync"],
            "overlap": overlap_figures(runs) if args.overlap else None,
            "mxnet_runs": runs["mxnet-local"] + runs["mxnet-sync"],
        }
        results.append(res)
        rows.append(
            [
                model,
                batch,
                fmt(1000 * loc["srit_s"] if loc["srit_s"] else None, ".2f"),
                fmt(1000 * syn["srit_s"] if syn["srit_s"] else None, ".2f"),
                fmt(res["ratio_srit"], ".2f"),
                fmt(1000 * loc["step_s"] if loc["step_s"] else None, ".2f"),
                fmt(1000 * syn["step_s"] if syn["step_s"] else None, ".2f"),
                fmt(res["ratio_step"], ".2f"),
                " ".join(fmt(p, ".2f") for p in pair_ratios),
                "yes" if res["goal_met"] else "no",
                fmt(1000 * mx_loc if mx_loc else None, ".2f"),
                fmt(1000 * mx_syn if mx_syn else None, ".2f"),
                fmt(res["mxnet_ratio"], ".2f"),
                fmt(ratio(mx_syn, syn["srit_s"]), ".2f"),
            ]
        )
    headers = [
        "model",
        "batch",
        "local ms",
        "1w+1s ms",
        "ratio",
        "local c+w ms",
        "1w+1s c+w ms",
        "ratio c+w",
        "pair ratios",
        f"<= {GOAL}",
        "MXNet local ms",
        "MXNet 1w+1s ms",
        "MXNet ratio",
        "1w+1s hetps/MXNet",
    ]
    print()
    print(
        "per-iteration medians (srit_s; c+w = compute_s + wait_s), 1 worker + 1 server "
        "(sync) vs local, same batch, A B A B"
    )
    print_table(headers, rows)
    if args.overlap:
        print()
        print(
            "server-side update (-m async, 1 worker + 1 server): step() waits for the pulls "
            "vs --overlap-forward (each layer waits for its own), per-iteration medians"
        )
        print_table(
            ["model", "local ms", "waits ms", "ratio", "overlap ms", "ratio", "overlap/waits"],
            [
                [
                    res["model"],
                    fmt(1000 * res["local_srit_s"] if res["local_srit_s"] else None, ".2f"),
                    fmt(1000 * o["async_srit_s"] if o["async_srit_s"] else None, ".2f"),
                    fmt(o["ratio_async"], ".2f"),
                    fmt(1000 * o["overlap_srit_s"] if o["overlap_srit_s"] else None, ".2f"),
                    fmt(o["ratio_overlap"], ".2f"),
                    fmt(o["overlap_vs_async"], ".3f"),
                ]
                for res in results
                for o in [res["overlap"]]
            ],
        )
    if mx_reason:
        print(f"MXNet: {mx_reason}")
    elif any(m not in MX_MODELS for m in models):
        others = ", ".join(m for m in models if m not in MX_MODELS)
        print(f"MXNet: not run for {others} (its script has {', '.join(MX_MODELS)} only)")
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "train_overhead" + (" --quick" if args.quick else ""),
                "machine": machine,
                "goal_ratio": GOAL,
                "mxnet": mx_reason or f"mxnet 1.9.1 ({args.mxnet_python})",
                "warmup": args.warmup,
                "results": results,
                "markdown": markdown_table(headers, rows),
                "total_s": time.monotonic() - t_start,
            },
        )
        log(f"wrote {args.json}")
    runs = [
        r
        for res in results
        for r in res["runs"] + res["mxnet_runs"] + ((res["overlap"] or {}).get("runs") or [])
    ]
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
