#!/usr/bin/env python
"""Checkpoints of an embedding table (row-sparse key) against the same table as a dense key,
in one run (2 workers, 2 servers, ``dist_sync``, Adam on the servers).

    .venv/bin/python benchmarks/table_checkpoint.py [--rows 1000000] [--rounds 20] [--json FILE]

Three ``hetps launch -n 2 -s 2`` runs of a table of ``--rows`` x 64 float32:

* row-sparse: ``--rounds`` training rounds of 4,096 ids per worker from a power law (hetps'
  click-data generator) push gradients of their rows; the checkpoint keeps the rows used,
  their Adam moments and step count;
* row-sparse full: 2 rounds that push every row (the checkpoint holds the whole table, in
  chunks);
* dense: the same table as a dense key after 2 rounds (every row has Adam moments); the
  checkpoint keeps the whole value and the whole optimizer state.

Each run takes 3 checkpoints (``hetps.kvstore.checkpoint.save``) and restores the last one 3
times (``Checkpoint.restore``, after the checksums were checked), and reports the median
seconds, the checkpoint's bytes on disk, and the most memory the first worker (which reads
the servers' parts and writes the files) held at once for a fourth save, by ``tracemalloc``
(numpy's arrays included).
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
import json, statistics, sys, time, tracemalloc
from pathlib import Path
import numpy as np
import hetps.kv
from hetps import optim
from hetps.kvstore import checkpoint
from hetps.tables.rowsparse import Table
from hetps.app.clicks import power_law_ids

mode, rows, rounds, batch, where = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
cols = 64
kv = hetps.kv.create("dist_sync")
kv.set_optimizer(optim.Adam(learning_rate=0.01))
r = kv.rank

def say(name, value):
    if r == 0:
        print(f"RESULT {name} {value!r}", flush=True)

if mode == "full":  # every row used: the checkpoint holds the whole table
    kv.init("emb", Table(rows, cols))
    for i in range(2):
        ids = np.arange(r, rows, kv.num_workers)
        kv.push("emb", (ids, np.full((ids.size, cols), 0.25, np.float32)))
elif mode == "sparse":
    kv.init("emb", Table(rows, cols))
    for i in range(rounds):
        ids = np.unique(power_law_ids(np.random.default_rng([r, i]), batch, rows))
        kv.push("emb", (ids, np.full((ids.size, cols), 0.25, np.float32)))
else:
    kv.init("emb", np.zeros((rows, cols), np.float32))
    grad = np.full((rows, cols), 0.25, np.float32)
    for i in range(2):
        kv.push("emb", grad)
    del grad
kv.barrier()
saves = []
for k in range(3):
    t0 = time.perf_counter()
    path = checkpoint.save(kv, where, k + 1)
    saves.append(time.perf_counter() - t0)
say("save_s", statistics.median(saves))
tracemalloc.start()  # (numpy's arrays are traced too) a fourth save, not timed
path = checkpoint.save(kv, where, 4)
say("peak_bytes", tracemalloc.get_traced_memory()[1])
tracemalloc.stop()
say("disk_bytes", sum(f.stat().st_size for f in Path(path).iterdir()))
restores = []
for k in range(3):
    ck = checkpoint.latest(where)
    kv.barrier()
    t0 = time.perf_counter()
    ck.restore(kv)
    restores.append(time.perf_counter() - t0)
say("restore_s", statistics.median(restores))
if mode != "dense":
    man = json.loads((Path(path) / "manifest.json").read_text())
    say("rows_saved", man["tables"][0]["rows_saved"])
kv.barrier()
"""


def run(script: Path, mode: str, rows: int, rounds: int, batch: int, where: Path) -> dict:
    cmd = [
        sys.executable, "-m", "hetps.cli", "launch", "-n", "2", "-s", "2", "--",
        sys.executable, str(script), mode, str(rows), str(rounds), str(batch), str(where),
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(
            f"table_checkpoint: a run failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}"
        )
    return {k: float(v) for k, v in re.findall(r"RESULT (\w+) ([\d.e+-]+)", res.stdout)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=20, help="training rounds before saving")
    ap.add_argument("--batch", type=int, default=4096, help="ids per batch per worker")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="hetps-tablecp-") as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(textwrap.dedent(WORKER))
        for mode in ("sparse", "full", "dense"):
            results[mode] = run(script, mode, args.rows, args.rounds, args.batch, Path(tmp) / mode)
            print(f"{mode} done", flush=True)
    sp, full, de = results["sparse"], results["full"], results["dense"]
    mb = 1e6
    print(
        f"\ntable {args.rows:,} x 64 float32 ({args.rows * 256 / mb:.0f} MB), Adam on the servers. "
        f"Row-sparse after {args.rounds} rounds: {sp['rows_saved']:,.0f} rows used "
        f"({100 * sp['rows_saved'] / args.rows:.1f}%); row-sparse full: every row used"
    )
    for name, key, unit, scale in (
        ("checkpoint on disk", "disk_bytes", "MB", mb),
        ("save (median of 3)", "save_s", "s", 1),
        ("restore (median of 3)", "restore_s", "s", 1),
        ("first worker's peak memory during a save", "peak_bytes", "MB", mb),
    ):
        print(
            f"{name}: row-sparse {sp[key] / scale:.2f} {unit} (ratio {sp[key] / de[key]:.3f}), "
            f"row-sparse full {full[key] / scale:.2f} {unit} (ratio {full[key] / de[key]:.3f}), "
            f"dense key {de[key] / scale:.2f} {unit}"
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
