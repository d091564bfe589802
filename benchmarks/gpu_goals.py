#!/usr/bin/env python
"""GPU workers against their own local step, in one run: every figure of the GPU goals.

    .venv/bin/python benchmarks/gpu_goals.py [--gpu 0] [--quick] [--json FILE]
        [--server-device cuda:0]

1. The step of 1 worker + 1 server (``hetps train -m sync``, the DistributedOptimizer: each
   gradient's copy to the host starts in its hook on backward's stream) over the same step
   alone (``-m local``), alternated A B A B, for resnet18-v1 at batch 64 and 16, lenet and mlp
   at batch 64 (goals: <= 1.25, <= 1.5, <= 1.3, <= 1.5).
2. Samples/s of 4 workers sharing the one device with 1 server over 1 worker with 1 server
   (goal >= 3): the sum over the workers of each one's median samples per second.

Without ``--gpu`` (or without CUDA) it runs the same measurements on the CPU and says so:
the figures are then not the GPU goals' (the tests run it that way, small). The server
sums and updates on the CPU unless ``--server-device cuda:N`` puts it on that GPU
(``HETPS_SERVER_DEVICE`` in every run; each server's log line is checked, so a figure never
comes from a server that ran elsewhere). Each run's step comes from its JSONL log
(benchmarks/train_overhead.py, whose ``run_one`` this reuses).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _common import PINNED_THREADS, fmt, machine_info, median, print_table, write_json  # noqa: E402
from train_overhead import ratio, run_one  # noqa: E402

#: (model, batch, goal for 1w+1s / local)
STEP_GOALS = [("resnet18-v1", 64, 1.25), ("resnet18-v1", 16, 1.5), ("lenet", 64, 1.3),
              ("mlp", 64, 1.5)]  # fmt: skip
SHARE_GOAL = 3.0
SHARE_MODEL = ("resnet18-v1", 64)


def log(text: str) -> None:
    print(f"[gpu-goals {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def samples_per_s(args: argparse.Namespace, model: str, batch: int, workers: int, name: str):
    """Samples/s of ``workers`` workers on the one device with 1 server: per worker the
    median of samples / round time over its rounds after warm-up, summed."""
    cmd = [sys.executable, "-m", "hetps.cli", "train", "-m", "sync", "-n", model,
           "-b", str(batch), "-l", "0.01", "--max-rounds", str(args.share_rounds),
           "-e", "1000000000", "--test-limit", "100", "--train-limit", str(args.train_limit),
           "-ld", args.logdir, "--run-name", name, "--seed", "0", "--progress", "lines",
           "--workers", str(workers), "--servers", "1"]  # fmt: skip
    if args.gpu is not None:
        cmd += ["-g", str(args.gpu)]
    if args.data_dir:
        cmd += ["-dd", args.data_dir]
    run_dir = os.path.join(args.logdir, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, **PINNED_THREADS, "PYTHONWARNINGS": "ignore"}
    with open(os.path.join(args.logdir, f"{name}.out"), "w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            timeout=900, check=False).returncode  # fmt: skip
    if not served_on(args.logdir, name, args.server_device):
        log(f"{name}: its server did not say it ran on {args.server_device} (see {name}.out)")
        return None
    total = 0.0
    for w in range(workers):
        path = os.path.join(run_dir, f"worker-{w}.jsonl")
        recs = []
        if os.path.exists(path):
            with open(path) as f:
                recs = [json.loads(line) for line in f if line.strip()]
        steady = [r for r in recs[args.warmup :] if "accuracy" not in r]
        sps = median(r["samples"] / r["srit_s"] for r in steady if r["srit_s"] > 0)
        if rc != 0 or sps is None:
            log(f"{name}: rc {rc}, worker {w} has no steady rounds (see {name}.out)")
            return None
        total += sps
    log(f"{name}: {workers} workers, {total:.1f} samples/s")
    return total


def server_device(device: str) -> bool:
    """Put every run's server on ``device`` (HETPS_SERVER_DEVICE); False, said why, when
    this machine cannot (a GPU asked for where torch sees none)."""
    if device.startswith("cuda"):
        try:
            import torch

            ok = torch.cuda.is_available()
        except ImportError:
            ok = False
        if not ok:
            log(f"--server-device {device}: torch sees no CUDA device here; use cpu, or run "
                "this on a machine with a GPU")  # fmt: skip
            return False
    os.environ["HETPS_SERVER_DEVICE"] = device
    return True


def served_on(logdir: str, name: str, device: str) -> bool:
    """Whether the run ``name``'s server said it summed on ``device`` (its first round's
    line; always, for cpu)."""
    if device == "cpu":
        return True
    try:
        with open(os.path.join(logdir, f"{name}.out")) as f:
            return f"(HETPS_SERVER_DEVICE={device})" in f.read()
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", type=int, default=None, help="CUDA device (default: 0 if any)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even with a GPU")
    ap.add_argument("--quick", action="store_true", help="1 pair, short runs")
    ap.add_argument("--pairs", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None, help="rounds per step run")
    ap.add_argument("--share-rounds", type=int, default=None)
    ap.add_argument("--models", default=None, help="comma-separated subset of the step goals")
    ap.add_argument("--no-share", action="store_true", help="skip the 4-workers measurement")
    ap.add_argument("--share-model", default=None, help="model:batch of the 4-workers run")
    ap.add_argument("--share-workers", type=int, default=4, help="workers sharing the device")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--train-limit", type=int, default=8192)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--logdir", default="/tmp/hetps-bench-gpu")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--server-device",
        default="cpu",
        help="where the server sums and updates: cpu or cuda:N (HETPS_SERVER_DEVICE)",
    )
    args = ap.parse_args()
    if not server_device(args.server_device):
        return 2
    device = "cpu"
    if not args.cpu:
        try:
            import torch

            if torch.cuda.is_available():
                args.gpu = 0 if args.gpu is None else args.gpu
                device = torch.cuda.get_device_name(args.gpu)
        except ImportError:
            pass
    if device == "cpu":
        args.gpu = None
        log("no CUDA device (or --cpu): measuring on the CPU; these are not the GPU goals")
    pairs = args.pairs or (1 if args.quick else 3)
    rounds = args.rounds or (40 if args.quick else 120)
    args.share_rounds = args.share_rounds or rounds
    os.makedirs(args.logdir, exist_ok=True)
    machine = machine_info()
    machine["device"] = device
    machine["server_device"] = args.server_device
    wanted = set(args.models.split(",")) if args.models else None
    rows, results = [], []
    for model, batch, goal in STEP_GOALS:
        if wanted is not None and model not in wanted:
            continue
        runs = {"local": [], "sync": []}
        for i in range(pairs):
            for kind in ("local", "sync"):  # A B A B
                name = f"{model}-b{batch}-{kind}-{i}"
                runs[kind].append(run_one(kind, model, batch, rounds, args, name))
                if kind == "sync" and not served_on(args.logdir, name, args.server_device):
                    log(f"{name}: its server did not say it ran on {args.server_device}")
                    return 1
        loc = median(r["srit_s"] for r in runs["local"] if r["srit_s"])
        syn = median(r["srit_s"] for r in runs["sync"] if r["srit_s"])
        rat = ratio(loc, syn)
        results.append({"model": model, "batch": batch, "local_s": loc, "sync_s": syn,
                        "ratio": rat, "goal": goal, "runs": runs})  # fmt: skip
        met = "yes" if rat is not None and rat <= goal else "no"
        rows.append([f"{model} b{batch}", fmt(loc and 1000 * loc, ".2f"),
                     fmt(syn and 1000 * syn, ".2f"), fmt(rat, ".2f"), f"<= {goal}", met])  # fmt: skip
    share = None
    if not args.no_share:
        model, batch = SHARE_MODEL
        if args.share_model:
            model, _, b = args.share_model.partition(":")
            batch = int(b or 64)
        one = samples_per_s(args, model, batch, 1, f"share-{model}-1w")
        n = args.share_workers
        four = samples_per_s(args, model, batch, n, f"share-{model}-{n}w")
        share = ratio(one, four)
        results.append({"share_model": model, "batch": batch, "workers": n, "one_sps": one,
                        "many_sps": four, "ratio": share, "goal": SHARE_GOAL})  # fmt: skip
        rows.append([f"{n} workers / 1 ({model} b{batch}, samples/s)", fmt(one, ".1f"),
                     fmt(four, ".1f"), fmt(share, ".2f"), f">= {SHARE_GOAL}",
                     "yes" if share is not None and share >= SHARE_GOAL else "no"])  # fmt: skip
    print(f"machine: {machine['cpu']}, {machine['cores']} cores; device: {device}; "
          f"server on: {args.server_device}")  # fmt: skip
    print_table(["case", "local (or 1w) ", "1w+1s (or 4w)", "ratio", "goal", "met"], rows)
    if args.json:
        write_json(args.json, {"machine": machine, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
