"""``hetps train`` on hosts reaches the flat run's accuracy: the same sync job (``-m sync
-n mlp`` on Fashion-MNIST, 4 workers, 2 servers, the same seed) run three ways in one go:

- **hosts**: ``--nproc-per-node 2``, 2 hosts of 2 workers, each host summing its gradients
  through shared memory and pushing once (docs/HOSTS.md);
- **hosts, off**: the same hosts with ``--host-aggregation off`` (every worker pushes its
  own; the servers still sum each round per host in host order);
- **flat**: 4 workers, each a host of its own (the servers sum as pushes come).

Reported: each run's test accuracy at its last evaluation (worker 0's log) and whether the
losses of every round of worker 0 are equal bit for bit between the first two (they must:
the same sum in the same order).

    .venv/bin/python benchmarks/host_train.py                 # ~3 minutes on 2 cores
    .venv/bin/python benchmarks/host_train.py --rounds 600 --json out.json
    .venv/bin/python benchmarks/host_train.py --balance aware   # every run planned by aware
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = {
    "hosts": ["--nproc-per-node", "2"],
    "hosts, off": ["--nproc-per-node", "2", "--host-aggregation", "off"],
    "flat": [],
}


def run_one(base: Path, name: str, flags: list[str], args: argparse.Namespace) -> dict:
    """One job; its accuracy, evaluations and losses from worker 0's log."""
    from hetps.metrics.records import read_jsonl

    py = sys.executable
    run = name.replace(", ", "-")
    cmd = [
        py, "-m", "hetps.cli", "launch", "-n", "4", "-s", "2", *flags,
        *(["--balance", args.balance] if args.balance else []), "--",
        py, "-m", "hetps.cli", "train", "-m", "sync", "-n", "mlp",
        "--train-limit", str(args.train_limit), "--test-limit", str(args.test_limit),
        "-b", "32", "-e", str(args.eval_every), "--max-rounds", str(args.rounds),
        "--seed", "0", "-ld", str(base), "--run-name", run, "--progress", "lines",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"the {name} run failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    recs, _ = read_jsonl(base / run / "worker-0.jsonl")
    evals = [r["accuracy"] for r in recs if r.get("accuracy") is not None]
    return {
        "run": name,
        "accuracy": evals[-1] if evals else None,
        "evaluations": evals,
        "losses": [r["loss"] for r in recs if "loss" in r],
        "plan_epochs": len({r["plan_epoch"] for r in recs if "plan_epoch" in r}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=300, help="rounds of each run")
    p.add_argument("--train-limit", type=int, default=12000, help="training examples")
    p.add_argument("--test-limit", type=int, default=2000, help="test examples")
    p.add_argument("--eval-every", type=int, default=50, help="rounds between evaluations")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--balance", help="a load plan for every run (hetps launch --balance)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hetps-host-train-") as tmp:
        runs = {name: run_one(Path(tmp), name, flags, args) for name, flags in RUNS.items()}
    same = runs["hosts"]["losses"] == runs["hosts, off"]["losses"]
    plan = f", --balance {args.balance}" if args.balance else ""
    print(f"hetps train -m sync -n mlp{plan}, 4 workers, 2 servers, {args.rounds} rounds, batch 32")
    print(f"{'run':12s} {'accuracy':>9s}  evaluations")
    for name, r in runs.items():
        evals = " ".join(f"{a:.4f}" for a in r["evaluations"])
        plans = f"  ({r['plan_epochs']} plans)" if args.balance else ""
        print(f"{name:12s} {r['accuracy']:9.4f}  {evals}{plans}")
    gap = abs(runs["hosts"]["accuracy"] - runs["flat"]["accuracy"])
    print(f"hosts vs flat: {gap:.4f} apart; hosts and hosts-off losses bit for bit: {same}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"setup": vars(args), "runs": runs, "bit_for_bit": same}, indent=1)
        )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
