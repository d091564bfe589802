#!/usr/bin/env python
"""Row-sparse keys against the same table as a dense key, in one run (2 workers, 2 servers).

    .venv/bin/python benchmarks/sparse_tables.py [--rows 1000000,10000000] [--json FILE]

Each table size is one ``hetps launch -n 2 -s 2`` (dist_sync, SGD on the servers, float32,
64 columns, tables start at zero). Every worker runs:

* Traffic: rounds that touch 1% of the table's rows (the same distinct rows on both workers:
  a row-sparse push of their gradients, then a ``row_sparse_pull`` of them), and, at the first
  size only, rounds of the whole table as a dense key (a push of its dense gradient, then a pull
  of the table). Bytes are the worker's own, counted by its transport (sent to and received
  from the servers, headers and ids included), per round; the ratio is sparse / dense.
* Speed: training steps of a batch of 4,096 ids from a power-law distribution (hetps'
  click-data generator): pull the batch's rows, push their gradients (sparse); or pull the
  whole table and push its dense gradient (dense, first size only). Samples/s = 2 workers x
  4,096 / median step time; the ratio is sparse / dense.
* Round time of the sparse step at each table size (it should follow the rows touched, about
  the same at every size, not the table's size).

Times are medians over the measured rounds; this machine is shared, so compare the ratios.
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

from _common import git_head  # noqa: E402

WORKER = """
import statistics, sys, time
import numpy as np
import hetps.kv
from hetps import optim
from hetps.kvstore.rowsparse import Table
from hetps.app.clicks import power_law_ids

rows, cols, batch, dense_too = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
kv = hetps.kv.create("dist_sync")
kv.set_optimizer(optim.SGD(learning_rate=0.01))
r = kv.rank

def link_bytes():
    return sum(a + b for a, b in kv._link_bytes().values())

def rounds(fn, n, warm=2):
    for i in range(warm):
        fn(i)
    kv.barrier()
    b0, times = link_bytes(), []
    for i in range(n):
        t0 = time.perf_counter()
        fn(warm + i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), (link_bytes() - b0) / n

def say(name, value):
    if r == 0:
        print(f"RESULT {name} {value!r}", flush=True)

kv.init("emb", Table(rows, cols))
touch = np.sort(np.random.default_rng(1).choice(rows, rows // 100, replace=False))
g1 = np.full((touch.size, cols), 0.5, np.float32)

def sparse_touch(i):
    kv.push("emb", (touch, g1))
    kv.row_sparse_pull("emb", row_ids=touch)

t, b = rounds(sparse_touch, 5)
say("touch_bytes", b)
say("touch_s", t)

def sparse_step(i):
    ids = power_law_ids(np.random.default_rng([r, i]), batch, rows)
    got = kv.row_sparse_pull("emb", row_ids=ids)         # the batch's distinct rows
    grad = (got.indices, got.data * 0.0 + 0.25)          # stands in for backward
    kv.push("emb", grad)

t, b = rounds(sparse_step, 30)
say("step_s", t)
say("step_bytes", b)
kv.barrier()
if dense_too:
    kv.init("dense", np.zeros((rows, cols), np.float32))
    table = np.empty((rows, cols), np.float32)
    grad = np.zeros((rows, cols), np.float32)

    def dense_touch(i):
        kv.push("dense", grad)
        kv.pull("dense", out=table)

    t, b = rounds(dense_touch, 3, warm=1)
    say("dense_bytes", b)
    say("dense_round_s", t)

    def dense_step(i):
        ids = power_law_ids(np.random.default_rng([r, i]), batch, rows)
        kv.pull("dense", out=table)
        rows_ = table[ids]                                 # the lookup
        grad.fill(0)
        np.add.at(grad, ids, rows_ * 0.0 + 0.25)
        kv.push("dense", grad)

    t, b = rounds(dense_step, 3, warm=1)
    say("dense_step_s", t)
kv.barrier()
"""


def run(script: Path, rows: int, cols: int, batch: int, dense: bool) -> dict[str, float]:
    cmd = [
        sys.executable, "-m", "hetps.cli", "launch", "-n", "2", "-s", "2", "--",
        sys.executable, str(script), str(rows), str(cols), str(batch), "1" if dense else "0",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"sparse_tables: a run failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    return {k: float(v) for k, v in re.findall(r"RESULT (\w+) ([\d.e+-]+)", res.stdout)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1000000,10000000", help="table sizes, comma-separated")
    ap.add_argument("--cols", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4096, help="ids per batch per worker")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sizes = [int(x) for x in args.rows.split(",")]
    results = {}
    with tempfile.TemporaryDirectory(prefix="hetps-sparse-") as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(textwrap.dedent(WORKER))
        for i, rows in enumerate(sizes):
            results[rows] = run(script, rows, args.cols, args.batch, dense=i == 0)
            print(f"{rows} rows done", flush=True)
    first = results[sizes[0]]
    mb = first["dense_bytes"] / 1e6
    print(f"\ntable {sizes[0]} x {args.cols} float32 ({sizes[0] * args.cols * 4 / 1e6:.0f} MB)")
    print(
        f"traffic, a round touching 1% of rows: sparse {first['touch_bytes'] / 1e6:.2f} MB, "
        f"dense push+pull {mb:.1f} MB per worker: ratio {first['touch_bytes'] / first['dense_bytes']:.4f}"
    )
    sps = 2 * args.batch / first["step_s"]
    dps = 2 * args.batch / first["dense_step_s"]
    print(
        f"speed, {args.batch} ids per batch per worker: sparse {sps:,.0f} samples/s "
        f"({first['step_s'] * 1e3:.1f} ms/step), dense {dps:,.0f} samples/s "
        f"({first['dense_step_s'] * 1e3:.0f} ms/step): ratio {sps / dps:.1f}x"
    )
    print("round time of the sparse step by table size:")
    for rows in sizes:
        res = results[rows]
        print(
            f"  {rows:>11,d} rows: {res['step_s'] * 1e3:6.1f} ms/step, "
            f"{res['step_bytes'] / 1e6:.2f} MB per worker per step "
            f"(x{res['step_s'] / first['step_s']:.2f} of the first size)"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"commit": git_head(str(ROOT)), "args": vars(args), "results": results}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
