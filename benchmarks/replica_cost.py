"""What copies of every key (``--replicas 2``) cost a dist_sync round, against none; or,
with ``--feature elastic``, what ``--elastic 1`` costs (each round kept per worker on the
servers until it is complete, then summed); or, with ``--feature table``, what copies cost
an embedding table's round (each worker pushes the same N distinct rows of a table of 2^20
rows x 16 float32, then reads them back with ``row_sparse_pull``; SGD with momentum on the
servers, so each copy is the round's ids and per-row sums, applied again lazily).

    .venv/bin/python benchmarks/replica_cost.py [--repeats 5] [--rounds 100] [--json FILE]
    .venv/bin/python benchmarks/replica_cost.py --feature elastic
    .venv/bin/python benchmarks/replica_cost.py --feature table

Each run is ``hetps launch -n 2 -s 2 [--replicas 2]`` of a loop of push-then-pull rounds of
one key per size (4 KiB, 1 MiB, 16 MiB of float32), with an SGD optimizer on the servers (so
each copy is the merged gradient, applied again on the replica). The two settings are run
alternately, ``--repeats`` times each; per size it prints the median seconds per round of each
and their ratio (replicas / none). A copy costs one server-to-server send of the merged
pushes and one acknowledgement before a round is answered.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import git_head, median  # noqa: E402

SIZES = {"4KiB": 1 << 10, "1MiB": 1 << 18, "16MiB": 1 << 22}  # float32 elements
TABLE_SIZES = {"256rows": 256, "4096rows": 4096, "65536rows": 65536}  # rows pushed a round

WORKER = """
import os, sys, time
import numpy as np
import hetps.kv
from hetps import optim

rounds = int(sys.argv[1])
sizes = [int(x) for x in sys.argv[2].split(",")]
kv = hetps.kv.create("dist_sync")
kv.set_optimizer(optim.SGD(learning_rate=0.01))
for n in sizes:
    key = f"k{n}"
    kv.init(key, np.zeros(n, np.float32))
    grad = np.ones(n, np.float32)
    out = np.empty(n, np.float32)
    for _ in range(5):  # warm-up: rings, buffers
        kv.push(key, grad)
        kv.pull(key, out=out)
    kv.barrier()
    t0 = time.perf_counter()
    for _ in range(rounds):
        kv.push(key, grad)
        kv.pull(key, out=out)
    dt = (time.perf_counter() - t0) / rounds
    if kv.rank == 0:
        print(f"ROUND {n} {dt:.6f}", flush=True)
"""


TABLE_WORKER = """
import os, sys, time
import numpy as np
import hetps.kv
from hetps import optim
from hetps.tables.rowsparse import Table

rounds = int(sys.argv[1])
sizes = [int(x) for x in sys.argv[2].split(",")]
kv = hetps.kv.create("dist_sync")
kv.set_optimizer(optim.SGD(learning_rate=0.01, momentum=0.9))
for n in sizes:
    key = f"t{n}"
    kv.init(key, Table(1 << 20, 16, scale=0.1))
    ids = np.random.default_rng(kv.rank).choice(1 << 20, n, replace=False)
    grad = np.ones((n, 16), np.float32)
    for _ in range(5):  # warm-up: rings, buffers, the rows' first values
        kv.push(key, (ids, grad))
        kv.row_sparse_pull(key, row_ids=ids)
    kv.barrier()
    t0 = time.perf_counter()
    for _ in range(rounds):
        kv.push(key, (ids, grad))
        kv.row_sparse_pull(key, row_ids=ids)
    dt = (time.perf_counter() - t0) / rounds
    if kv.rank == 0:
        print(f"ROUND {n} {dt:.6f}", flush=True)
"""

FLAGS = {
    "replicas": ["--replicas", "2"],
    "elastic": ["--elastic", "1"],
    "table": ["--replicas", "2"],
}


def run(script: Path, flags: list[str], rounds: int, sizes: dict) -> dict[int, float]:
    cmd = [
        sys.executable, "-m", "hetps.cli", "launch", "-n", "2", "-s", "2",
        *flags, "--", sys.executable, str(script), str(rounds),
        ",".join(str(n) for n in sizes.values()),
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"replica_cost: a run failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    return {int(n): float(t) for n, t in re.findall(r"ROUND (\d+) ([\d.]+)", res.stdout)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--feature", choices=sorted(FLAGS), default="replicas", help="what is compared with none"
    )
    args = ap.parse_args()
    flags = {1: [], 2: FLAGS[args.feature]}
    sizes = TABLE_SIZES if args.feature == "table" else SIZES
    times: dict[int, dict[int, list[float]]] = {1: {}, 2: {}}
    with tempfile.TemporaryDirectory(prefix="hetps-replica-cost-") as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(textwrap.dedent(TABLE_WORKER if args.feature == "table" else WORKER))
        for i in range(args.repeats):
            for which in (1, 2) if i % 2 == 0 else (2, 1):
                for n, t in run(script, flags[which], args.rounds, sizes).items():
                    times[which].setdefault(n, []).append(t)
            print(f"repeat {i + 1} of {args.repeats} done", flush=True)
    rows = []
    label = " ".join(flags[2]).lstrip("-")
    column = "elastic1_s" if args.feature == "elastic" else "replicas2_s"
    print(f"\n{'size':>9s} {'none s/round':>13s} {label:>11s} {'ratio':>6s}")
    for name, n in sizes.items():
        a, b = median(times[1][n]), median(times[2][n])
        rows.append({"size": name, "elements": n, "none_s": a, column: b, "ratio": b / a})
        print(f"{name:>9s} {a:13.6f} {b:11.6f} {b / a:6.2f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "commit": git_head(str(ROOT)),
                    "feature": args.feature,
                    "rounds": args.rounds,
                    "repeats": args.repeats,
                    "rows": rows,
                    "raw": {str(r): {str(n): v for n, v in t.items()} for r, t in times.items()},
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
